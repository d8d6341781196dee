"""The Python API: ``LLM`` generates from prompts with a ``Pipeline``; ``RequestOutput`` is
what each prompt gets back."""

from __future__ import annotations

import logging
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence as Seq

from pydantic import ValidationError
from tqdm.auto import tqdm

from tessellm.core.config import PipelineConfig
from tessellm.core.engine.chat import split_images
from tessellm.core.engine.embed import EmbedAndScore, EmbeddingOutput, PooledInput, ScoreOutput  # noqa: F401 (re-exported)
from tessellm.core.engine.gc_freeze import frozen_heap
from tessellm.core.engine.pipeline import Pipeline
from tessellm.core.engine.request import RequestState
from tessellm.core.errors import InvalidRequestError, validation_problems
from tessellm.core.interfaces.sequence import SamplingParams
from tessellm.core.model.vision import read_image

logger = logging.getLogger(__name__)


@dataclass
class CompletionOutput:
    """One generated sample."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[Any] | None = None
    """With ``SamplingParams.logprobs``: a ``TokenLogprob`` (logprob, top alternatives) per token."""
    score: float | None = None
    """A beam-search result's score (``Sequence.score``); None for other decoding."""


@dataclass
class RequestOutput:
    """A finished request: its prompt, its samples and its timings (seconds)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    ttft_s: float | None
    e2e_s: float
    num_cached_tokens: int = 0
    """Prompt tokens served from the prefix cache (their K/V reused, not computed)."""
    prompt_logprobs: list[Any] | None = None
    """With ``SamplingParams.prompt_logprobs``: per prompt token, None for the first, then a
    ``TokenLogprob`` (its log-probability given the tokens before it, top alternatives)."""

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


def to_sampling_params(value: Any) -> SamplingParams:
    """A ``SamplingParams`` from one, a mapping or None (the defaults); InvalidRequestError
    naming each bad field otherwise."""
    if value is None:
        return SamplingParams()
    if isinstance(value, SamplingParams):
        return value
    try:
        return SamplingParams.model_validate(value)
    except ValidationError as exc:
        raise InvalidRequestError(validation_problems(exc)) from None


def _per_prompt(value: Any, n: int, name: str, kind: type | tuple[type, ...]) -> list[Any]:
    """One value per prompt from a single value or a list of ``n``."""
    values = list(value) if isinstance(value, (list, tuple)) else [value] * n
    if len(values) != n:
        raise InvalidRequestError(f"{len(values)} {name} values for {n} prompts")
    bad = [v for v in values if not isinstance(v, kind) or isinstance(v, bool)]
    if bad:
        raise InvalidRequestError(f"{name} must be {'an int' if kind is int else 'a string or None'}, not {bad[0]!r}")
    return values


def encode_prompt(tokenizer: Any, prompt: str, *, chat: bool = False) -> list[int]:
    """A text prompt's token ids (``chat``: as the one user message of a chat, through the
    tokenizer's chat template); InvalidRequestError for a prompt that is no text or empty."""
    if not isinstance(prompt, str):
        raise InvalidRequestError(f"prompt must be a string or a list of token ids, not {type(prompt).__name__}",
                                  field="prompt")
    if not prompt:
        raise InvalidRequestError("prompt is empty; give at least one character", field="prompt")
    if chat:
        if not getattr(tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template; run without --chat")
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                             tokenize=False, add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(prompt)["input_ids"]


class LLM(EmbedAndScore):
    """Generate text from prompts with a pipeline: ``LLM().generate(["Hello"])``; with an
    embedding or reranking pipeline, ``embed(texts)`` and ``score(query, documents)``."""

    def __init__(self, config: PipelineConfig | dict | str | Path | None = None, *,
                 overrides: list[str] | None = None, pipeline: Pipeline | None = None):
        self.pipeline = pipeline or Pipeline.from_config(config, overrides)
        self.tokenizer = self.pipeline.tokenizer
        self.engine = self.pipeline.engine

    def encode(self, prompt: str, *, chat: bool = False) -> list[int]:
        return encode_prompt(self.tokenizer, prompt, chat=chat)

    def generate(self, prompts: str | Seq[str] | Seq[list[int]], params: Any = None, *, chat: bool = False,
                 progress: bool | None = None, priority: int | Seq[int] = 0,
                 cache_salt: str | None | Seq[str | None] = None,
                 lora: str | None | Seq[str | None] = None,
                 images: Seq[Seq[Any] | None] | None = None) -> list[RequestOutput]:
        """Run every prompt as one batch; outputs come back in prompt order.

        ``images`` (a model that takes images): per prompt, its images (PIL images, paths or
        the files' bytes) or None; a text prompt holds one ``image_marker`` per image where the
        image goes (none: the images go before the text), a chat prompt (``chat``) gets them
        as image parts before its text.

        ``params`` is one SamplingParams (or dict) for all prompts or a list of them;
        ``priority`` (lower runs first under the `priority` scheduling policy),
        ``cache_salt`` (a tenant key: prefix-cache blocks are shared only within one salt) and
        ``lora`` (the registered LoRA adapter to run under, None for the base model) are one
        value for all prompts or one per prompt."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if not prompts:
            raise InvalidRequestError("no prompts given")
        per = [to_sampling_params(p) for p in params] if isinstance(params, list) else [to_sampling_params(params)] * len(prompts)
        if len(per) != len(prompts):
            raise InvalidRequestError(f"{len(per)} sampling params for {len(prompts)} prompts")
        priorities = _per_prompt(priority, len(prompts), "priority", int)
        salts = _per_prompt(cache_salt, len(prompts), "cache_salt", (str, type(None)))
        adapters = _per_prompt(lora, len(prompts), "lora", (str, type(None)))
        encoded, processed = self._encode_prompts(prompts, images, chat)
        requests = [lambda rid, t=tokens, p=p, prio=prio, salt=salt, adapter=adapter, inputs=inputs:
                    self.engine.add_request(rid, t, p, priority=prio, cache_salt=salt, lora=adapter, images=inputs)
                    for tokens, p, prio, salt, adapter, inputs in zip(encoded, per, priorities, salts, adapters,
                                                                      processed)]
        ids, done = self._run_requests(requests, per, progress)
        return [self._output(done[i], prompt, tokens) for i, prompt, tokens in zip(ids, prompts, encoded)]

    def chat(self, messages: Seq[dict] | Seq[Seq[dict]], params: Any = None, *, progress: bool | None = None,
             lora: str | None = None, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Answer one conversation (a list of OpenAI-style messages) or several (a list of
        them), as one batch; outputs in order. A message's content is a string or a list of
        parts: text, and for a model that takes images, image parts (``image_url`` with a
        ``data:`` URL, ``input_image``, or ``{"type": "image", "image": ...}`` with a PIL
        image, a path or the file's bytes; core/engine/chat.py). Each conversation is rendered
        by the tokenizer's chat template (``chat_template_kwargs`` passed to it), its images
        processed as the checkpoint's processor does; ``params`` as for ``generate``."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model's tokenizer has no chat template; use generate with a prompt",
                                      field="messages")
        many = isinstance(messages, (list, tuple)) and bool(messages) and isinstance(messages[0], (list, tuple))
        conversations = list(messages) if many else [messages]
        per = [to_sampling_params(p) for p in params] if isinstance(params, list) else \
            [to_sampling_params(params)] * len(conversations)
        if len(per) != len(conversations):
            raise InvalidRequestError(f"{len(per)} sampling params for {len(conversations)} conversations")
        encoded = [self._encode_chat(c, add_generation_prompt, chat_template_kwargs or {}) for c in conversations]
        requests = [lambda rid, e=e, p=p: self.engine.add_request(rid, e[1], p, lora=lora, images=e[2])
                    for e, p in zip(encoded, per)]
        ids, done = self._run_requests(requests, per, progress)
        return [self._output(done[i], text, tokens) for i, (text, tokens, _) in zip(ids, encoded)]

    def _encode_chat(self, conversation: Any, add_generation_prompt: bool,
                     template_kwargs: dict[str, Any]) -> tuple[str, list[int], list[Any] | None]:
        """A conversation's rendered text, its token ids and its processed images (None without)."""
        rendered, images = split_images(conversation)
        processor = self.pipeline.image_processor if images else None
        if images and processor is None:
            raise InvalidRequestError(f"model {self.pipeline.spec.model_type!r} is a text-only model: it takes no "
                                      f"images; send the messages without image parts", field="images")
        try:
            text = self.tokenizer.apply_chat_template(rendered, tokenize=False,
                                                      add_generation_prompt=add_generation_prompt, **template_kwargs)
        except Exception as exc:  # the template's own error (a role it refuses, a missing variable)
            raise InvalidRequestError(f"the chat template could not render the messages: {exc}",
                                      field="messages") from None
        if not images:
            return text, self.tokenizer(text, add_special_tokens=False)["input_ids"], None
        out = processor.process(text, [read_image(item, i) for i, item in enumerate(images)])
        return text, out.token_ids, out.images

    def _run_requests(self, requests: list[Any], params: list[Any] | None,
                      progress: bool | None) -> tuple[list[str], dict[str, RequestState]]:
        """Admit each request (``requests[i](request_id)`` adds it) and step until all are done:
        their ids, in order, and their finished states. Whatever fails, no request (or its
        blocks) is left behind."""
        ids: list[str] = []
        with self.engine.lock:  # a server's engine thread, if any, waits until these are done
            try:
                for add in requests:
                    request_id = uuid.uuid4().hex
                    add(request_id)
                    ids.append(request_id)
                return ids, self._run(ids, params, progress)
            except BaseException:
                for request_id in ids:
                    self.engine.abort(request_id)
                raise

    def _encode_prompts(self, prompts: list[Any], images: Seq[Seq[Any] | None] | None,
                        chat: bool) -> tuple[list[list[int]], list[Any]]:
        """Each prompt's token ids and its processed images (None for a prompt without)."""
        pictures = [None] * len(prompts) if images is None else list(images)
        if len(pictures) != len(prompts):
            raise InvalidRequestError(f"{len(pictures)} image lists for {len(prompts)} prompts; give one per prompt "
                                      f"(None for a prompt without images)", field="images")
        encoded, processed = [], []
        for p, pics in zip(prompts, pictures):
            tokens, inputs = self._encode_with_images(p, pics, chat) if pics else (None, None)
            encoded.append(tokens if tokens is not None else
                           list(p) if isinstance(p, (list, tuple)) else self.encode(p, chat=chat))
            processed.append(inputs)
        return encoded, processed

    def _encode_with_images(self, prompt: Any, images: Seq[Any], chat: bool) -> tuple[list[int], list[Any]]:
        """A text prompt and its images through the model's processor: (token ids with the
        images' placeholders expanded, the processed images)."""
        processor = self.pipeline.image_processor
        if processor is None:
            raise InvalidRequestError(f"model {self.pipeline.spec.model_type!r} is a text-only model: it takes no "
                                      f"images; send the prompt without them", field="images")
        if not isinstance(prompt, str):
            raise InvalidRequestError("a prompt with images must be text (its image placeholders are expanded "
                                      "as the model's processor does), not token ids", field="images")
        if isinstance(images, (str, bytes)) or not isinstance(images, (list, tuple)):
            images = [images]
        pictures = [read_image(item, i) for i, item in enumerate(images)]
        if chat:
            content = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": prompt}]
            text = self.tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                                      add_generation_prompt=True)
            out = processor.process(text, pictures)
        else:
            if processor.image_marker not in prompt:
                prompt = processor.image_marker * len(pictures) + prompt
            out = processor.process(prompt, pictures, add_special_tokens=True)
        return out.token_ids, out.images

    def close(self) -> None:
        """Finish what outlives this LLM (a disk KV tier's queued writes); it can still generate."""
        self.pipeline.close()

    def load_lora(self, name: str, path: str | Path) -> None:
        """Register the PEFT adapter folder ``path`` as ``name`` (the pipeline must serve LoRA:
        ``lora.enabled``, or adapters in the config)."""
        with self.engine.lock:
            self.engine.load_lora(name, str(path))

    def unload_lora(self, name: str) -> None:
        """Unregister adapter ``name``; requests already running under it finish."""
        with self.engine.lock:
            self.engine.unload_lora(name)

    @property
    def lora_adapters(self) -> list[str]:
        """The names of the registered LoRA adapters."""
        return sorted(self.engine.lora.adapters) if self.engine.lora is not None else []

    def _run(self, ids: list[str], params: list[Any] | None, progress: bool | None) -> dict[str, RequestState]:
        """Step the engine until every request of ``ids`` is done; ``params`` None: pooling
        requests (the progress bar counts requests, not tokens)."""
        if progress is None:
            progress = sys.stderr.isatty()
        total = sum(p.max_tokens * p.n for p in params) if params is not None else len(ids)
        bar = tqdm(total=total, desc="generating" if params is not None else "pooling",
                   unit="tok" if params is not None else "req", disable=not progress, leave=False)
        wanted = set(ids)
        done: dict[str, RequestState] = {}
        before = self.engine.stats.generated_tokens
        with frozen_heap():  # the collector's full passes skip the pipeline's objects meanwhile
            while wanted - done.keys():
                for state in self.engine.step():
                    if state.request_id in wanted:
                        done[state.request_id] = self.engine.pop_finished(state.request_id)
                failed = [r for r in ids if r in self.engine.failures]
                if failed:  # the engine aborted a request whose own forward raised
                    errors = [self.engine.failures.pop(r) for r in failed]
                    raise errors[0]
                bar.update((self.engine.stats.generated_tokens - before if params is not None else len(done)) - bar.n)
        bar.close()
        return done

    def _output(self, state: RequestState, prompt: Any, tokens: list[int]) -> RequestOutput:
        outs = []
        for seq in sorted(state.seqs, key=lambda s: s.sample_index):
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
            if seq.stop_text_len is not None:
                text = text[: seq.stop_text_len]
            outs.append(CompletionOutput(seq.sample_index, text, list(seq.output_token_ids),
                                         seq.finish_reason.value if seq.finish_reason else None,
                                         list(seq.logprobs) if seq.params.logprobs is not None else None,
                                         seq.score))
        first = state.seqs[0]
        ends = [s.finish_time for s in state.seqs if s.finish_time is not None]
        return RequestOutput(state.request_id, prompt if isinstance(prompt, str) else None, tokens, outs,
                             None if first.first_token_time is None else first.first_token_time - first.arrival_time,
                             (max(ends) if ends else time.perf_counter()) - first.arrival_time,
                             first.num_cached_tokens or 0, prompt_logprobs_of(first))


def prompt_logprobs_of(seq: Any) -> list[Any] | None:
    """The prompt's log-probabilities a finished sequence recorded (None where its request
    asked for none; a one-token prompt has only the first token's None)."""
    if seq.params.prompt_logprobs is None:
        return None
    return list(seq.prompt_logprobs) or [None]

