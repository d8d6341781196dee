"""Request and response bodies of the OpenAI-compatible API (the fields tessellm honours).

No field is ignored without a word: a field of OpenAI's API (or vLLM's extensions) that would
change the result and that tessellm does not implement is a 400 naming it
(``NOT_IMPLEMENTED``); fields that cannot change the result (``user``, ``metadata``, ...)
are accepted and logged once; any other unknown field is logged once as ignored, as vLLM
does. A known field of the wrong type or range is a 400.
"""

from __future__ import annotations

import logging
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.sequence import LogitsProcessorRequest
from tessellm.serve.structured import ResponseFormat, StructuredOutputs
from tessellm.serve.tools import Tool, ToolCallItem, ToolCalling, ToolChoice

logger = logging.getLogger(__name__)

NOT_IMPLEMENTED: dict[str, Any] = {
    # field -> its value that means "not used" (any other value changes the result)
    "suffix": None, "functions": None, "function_call": None, "guided_json": None,
    "guided_regex": None, "guided_choice": None, "guided_grammar": None, "prompt_logprobs": None,
    "prediction": None, "audio": None, "modalities": None,
}
"""Fields that change the result, which this server does not implement yet."""

NO_EFFECT = frozenset({"user", "metadata", "store", "service_tier", "stream_options", "request_id"})
"""Fields accepted and logged once: they cannot change the tokens returned."""

_logged: set[str] = set()


def _unused(field: str, value: Any) -> bool:
    default = NOT_IMPLEMENTED[field]
    if value is None or value == default:
        return True
    return field in ("functions", "modalities") and not value


def _hint(field: str) -> str:
    if field.startswith("guided_"):
        return f"; use structured_outputs: {{{field[7:]}: ...}}"
    if field in ("functions", "function_call"):
        return "; use tools and tool_choice"
    return "; leave it out"


def _log_once(field: str, message: str) -> None:
    if field not in _logged:
        _logged.add(field)
        logger.warning(message)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage;
    ``continuous_usage_stats`` (vLLM's) puts the usage so far in every chunk."""

    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False


RESERVED_TEMPLATE_ARGS = frozenset({"messages", "conversation", "tools", "documents", "tokenize", "chat_template",
                                    "add_generation_prompt", "continue_final_message", "return_dict"})
"""Arguments of the template rendering that ``chat_template_kwargs`` may not set (the request
has fields for the ones it may choose)."""


class ChatTemplateFields(BaseModel):
    """How messages are rendered, as vLLM's chat and tokenize requests take it:
    ``add_generation_prompt`` ends the text with the opening of the assistant's turn;
    ``continue_final_message`` leaves the last message open for the model to continue (it
    cannot be set with an explicit ``add_generation_prompt: true``); ``chat_template_kwargs``
    are passed to the template (``enable_thinking``, ...)."""

    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: Optional[dict[str, Any]] = None

    @model_validator(mode="after")
    def _one_ending(self):
        if self.continue_final_message and self.add_generation_prompt and "add_generation_prompt" in \
                self.model_fields_set:
            raise PydanticCustomError("one_form", "continue_final_message and add_generation_prompt cannot both "
                                      "be true", {"field": "continue_final_message"})
        reserved = sorted(RESERVED_TEMPLATE_ARGS & set(self.chat_template_kwargs or ()))
        if reserved:
            raise PydanticCustomError("reserved", "chat_template_kwargs may not set {names}: the request has its "
                                      "own fields for them, or the server sets them", {"names": ", ".join(reserved),
                                                                                      "field": "chat_template_kwargs"})
        return self

    def template_ending(self) -> dict[str, Any]:
        """``render_chat``'s keyword arguments for this request's ending and template arguments."""
        return {"add_generation_prompt": self.add_generation_prompt and not self.continue_final_message,
                "continue_final_message": self.continue_final_message,
                "template_kwargs": dict(self.chat_template_kwargs or {})}


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _no_field_ignored(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for field, value in data.items():
            if field in cls.model_fields:
                continue
            if field in NOT_IMPLEMENTED:
                if not _unused(field, value):
                    raise PydanticCustomError("not_supported", "{field} is not supported by this server (got "
                                              "{value}){hint}", {"field": field, "value": repr(value),
                                                                 "hint": _hint(field)})
            elif field in NO_EFFECT:
                _log_once(field, f"request field {field!r} accepted; it does not change the result")
            else:
                _log_once(field, f"request field {field!r} is unknown and ignored")
        best_of = data.get("best_of")
        if best_of is not None and best_of != data.get("n", 1) and not data.get("use_beam_search"):
            raise PydanticCustomError("not_supported", "best_of is supported with use_beam_search (the beam width) "
                                      "or equal to n (got {value})", {"field": "best_of", "value": repr(best_of)})
        return data

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
    same salt (requests without one share with each other), so one tenant's prompts never
    serve another's."""
    logit_bias: Optional[dict[str, float]] = None
    """Token id (as a string, as OpenAI's API sends it) -> a bias in [-100, 100] added to its
    logit before the token is picked."""
    min_tokens: int = Field(0, ge=0)
    """Extension (as vLLM's): generate at least this many tokens before a stop can end it."""
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """OpenAI's: subtracted from the logit of every token the output holds so far."""
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    """OpenAI's: subtracted from a token's logit once per time the output holds it so far."""
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0)
    """Extension (as vLLM's): the logits of the prompt's and output's tokens divided by it where
    positive, multiplied where negative; 1 leaves them alone."""
    bad_words: list[str] = Field(default_factory=list)
    """Extension (as vLLM's): words the output may not contain."""
    allowed_token_ids: Optional[list[int]] = None
    """Extension (as vLLM's): the only token ids the output may hold."""
    no_repeat_ngram_size: int = Field(0, ge=0, le=1024)
    """Extension (transformers'): no n-gram of this size occurs twice; 0 turns it off."""
    logits_processors: list[LogitsProcessorRequest] = Field(default_factory=list)
    """Extension (vLLM's field name): logits-processor plugins, each a name or ``{"name": ...,
    "args": {...}}``; an unknown name or arguments its plugin refuses is a 400 at admission."""
    response_format: Optional[ResponseFormat] = None
    """OpenAI's: ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema":
    {"name", "schema", "strict"}}`` constrains the output (``text``: no constraint)."""
    structured_outputs: Optional[StructuredOutputs] = None
    """Extension (vLLM's name): exactly one of ``json`` (a schema), ``regex``, ``choice``,
    ``grammar`` (EBNF) or ``json_object``; the openai library sends it in ``extra_body``."""
    extra_args: Optional[dict[str, Any]] = None
    """Extension: settings for the decoding plugin beyond these fields, validated by that
    plugin (``SamplingParams.extra_args``); the openai library sends them with
    ``extra_body={"extra_args": {...}}``."""
    use_beam_search: bool = False
    """Extension (vLLM's): beam search of width ``best_of`` (default: ``n``), returning the
    ``n`` best; greedy (``temperature`` 0 unless set), not streamed. Needs a server started
    with ``--set decoding.name=beam``."""
    best_of: Optional[int] = Field(None, ge=1, le=64)
    """With ``use_beam_search``, the beam width; otherwise only equal to ``n``."""
    length_penalty: float = 1.0
    """Extension (vLLM's, transformers' meaning): beam search scores a finished hypothesis by
    its log-probability over its length to this power."""
    early_stopping: Union[bool, Literal["never"]] = False
    """Extension (vLLM's, transformers' meaning): when beam search stops (True, False, "never")."""

    def beam_args(self) -> dict[str, Any]:
        """The `beam` decoder's ``extra_args`` for ``use_beam_search`` (empty without it)."""
        if not self.use_beam_search:
            return {}
        return {"num_beams": self.best_of or self.n, "length_penalty": self.length_penalty,
                "early_stopping": self.early_stopping}

    @field_validator("presence_penalty", "frequency_penalty", "repetition_penalty", "bad_words",
                     "no_repeat_ngram_size", "logits_processors", mode="before")
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI's clients send null for a field left unset: it means the default."""
        if value is None:
            return cls.model_fields[info.field_name].get_default(call_default_factory=True)
        return value

    def logits_fields(self) -> dict[str, Any]:
        """The logits processors' fields, as ``SamplingParams`` takes them."""
        return dict(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                    repetition_penalty=self.repetition_penalty, bad_words=self.bad_words,
                    allowed_token_ids=self.allowed_token_ids, no_repeat_ngram_size=self.no_repeat_ngram_size,
                    logits_processors=self.logits_processors)

    def bias(self) -> dict[int, float]:
        """``logit_bias`` with integer token ids (InvalidRequestError naming a key that is not one)."""
        out = {}
        for key, value in (self.logit_bias or {}).items():
            if not key.strip().lstrip("-").isdigit():
                raise InvalidRequestError(f"logit_bias keys are token ids, got {key!r}")
            out[int(key)] = value
        return out

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class CompletionRequest(_Sampling):
    """POST /v1/completions: ``prompt`` is a text, a list of texts, a list of token ids or a
    list of token-id lists (a batch: choice ``prompt_index * n + sample``)."""

    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = Field(16, ge=0)
    """0 only with ``echo``: score the prompt without generating."""
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    """Log-probabilities of each token and of this many alternatives (up to 20, as vLLM)."""
    echo: bool = False
    """Return the prompt before the completion; with ``logprobs``, the prompt tokens'
    log-probabilities too (the first token's is null), from the forward that prefills."""

    def prompts(self) -> list[Union[str, list[int]]]:
        """The batch: every prompt, a text or token ids (InvalidRequestError if empty)."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise InvalidRequestError("prompt is an empty list; give a text, token ids, or a list of either")
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImageUrl(BaseModel):
    model_config = ConfigDict(extra="ignore")

    url: str
    detail: Optional[Literal["auto", "low", "high"]] = None


class ImageUrlPart(BaseModel):
    """An image in a message (OpenAI's ``image_url`` part): a ``data:image/...;base64,`` URL
    (an http(s) URL is refused: this server fetches nothing)."""

    type: Literal["image_url"]
    image_url: ImageUrl


class ChatMessage(BaseModel):
    """One message; an assistant's earlier tool calls and a tool's result as OpenAI sends
    them (content may be None beside tool_calls, or a list of text and image parts; a list
    of text parts only is joined into one text)."""

    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: Union[str, list[Union[TextPart, ImageUrlPart]], None] = None
    tool_calls: Optional[list[ToolCallItem]] = None
    tool_call_id: Optional[str] = None
    name: Optional[str] = None

    @model_validator(mode="after")
    def _has_content(self):
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a {self.role} message needs content")
        if isinstance(self.content, list) and all(isinstance(part, TextPart) for part in self.content):
            self.content = "".join(part.text for part in self.content)
        return self


class ChatCompletionRequest(ChatTemplateFields, _Sampling):
    """POST /v1/chat/completions: messages rendered with the model's chat template (how:
    ``ChatTemplateFields``)."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    tools: Optional[list[Tool]] = None
    """Functions the model may call (their ``parameters`` are JSON schemas)."""
    tool_choice: Optional[ToolChoice] = None
    """``none``, ``auto`` (the default with tools), ``required`` or ``{"type": "function",
    "function": {"name": ...}}``; the last two are enforced by a grammar."""
    parallel_tool_calls: Optional[bool] = None
    """False: at most one call under ``required``."""

    def tool_calling(self) -> ToolCalling | None:
        if not self.tools:
            if self.tool_choice not in (None, "none", "auto"):
                raise InvalidRequestError("tool_choice asks for a tool call, but the request declares no tools")
            return None
        return ToolCalling(self.tools, self.tool_choice, self.parallel_tool_calls)


class TokenizeRequest(ChatTemplateFields):
    """POST /tokenize, vLLM's two forms in one: ``prompt`` (a text) or ``messages`` (a chat,
    rendered with the model's chat template as /v1/chat/completions renders it)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = Field(None, min_length=1)
    add_special_tokens: Optional[bool] = None
    """Add the tokenizer's special tokens (BOS, ...) around the text: by default yes for a
    prompt, no for messages (their template writes them)."""
    tools: Optional[list[Tool]] = None
    """Messages: the tools offered, rendered as the chat route renders them."""
    return_token_strs: bool = False
    """Also return each token as the tokenizer's vocabulary spells it."""

    @model_validator(mode="after")
    def _one_form(self):
        if (self.prompt is None) == (self.messages is None):
            raise PydanticCustomError("one_form", "give exactly one of prompt (a text) and messages (a chat)")
        return self


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    tokens: list[int]


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody
