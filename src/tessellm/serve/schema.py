"""Request and response bodies of the OpenAI-compatible API (the fields tessellm honours).

Unknown fields are ignored, as OpenAI's own server and vLLM do (clients send options such as
``user`` or ``frequency_penalty``); a known field of the wrong type or range is a 400.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = Field(None, ge=0)
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    ignore_eos: bool = False
    """tessellm's extension (as vLLM's): keep generating past EOS, for benchmarks."""
    top_k: int = Field(0, ge=0)
    """Extension (as vLLM's): keep the top_k most likely tokens; 0 keeps all."""
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    """Extension (as vLLM's): keep tokens at least min_p times as likely as the most likely one."""
    cache_salt: Optional[str] = Field(None, min_length=1)
    """Extension (as vLLM's): the prefix cache shares blocks only between requests with the
    same salt (and requests without one), so one tenant's prompts never serve another's."""
    extra_args: Optional[dict[str, Any]] = None
    """Extension: settings for the decoding plugin beyond these fields, validated by that
    plugin (``SamplingParams.extra_args``); the openai library sends them with
    ``extra_body={"extra_args": {...}}``."""

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """POST /v1/completions: ``prompt`` is text or token ids (one prompt per request)."""

    prompt: Union[str, list[int]]
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=5)
    """Log-probabilities of each token and of this many alternatives (OpenAI allows up to 5)."""


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str


class ChatCompletionRequest(_Sampling):
    """POST /v1/chat/completions: messages rendered with the model's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=5)


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
