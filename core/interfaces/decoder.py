"""The decoder interface: logits in, accepted tokens out; and ``DecoderContext``, what a
decoder may use of its pipeline (a speculative decoder runs draft forwards through it)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Sequence as Layers

import torch
from pydantic import ValidationError

from tessellm.core.errors import InvalidRequestError, validation_problems
from tessellm.core.interfaces.batch import BatchMetadata, ScheduledSeq, SchedulerOutput
from tessellm.core.interfaces.cache import CacheManager
from tessellm.core.interfaces.sequence import SamplingParams, Sequence
from tessellm.core.interfaces.spec import ModelSpec
from tessellm.core.plugin import Plugin, PluginOptions
from tessellm.core.version import api_minor

DECODER_FIELDS: dict[str, str] = {"temperature": "1.0", "top_k": "1.0", "top_p": "1.0", "seed": "1.0", "n": "1.0",
                                  "min_p": "1.1"}
"""The ``SamplingParams`` fields a decoder applies itself, with the plugin-API version that
added each. (The engine applies the others for every decoder: max_tokens, min_tokens, stop,
logprobs, logit_bias, structured_output; ``extra_args`` go to the decoder's ``RequestArgs``.)
A request that sets a field newer than a decoder's ``api_version`` to other than its default
is refused for that decoder, unless the decoder lists the field in ``request_fields``: a
decoder cannot honour what did not exist when it was written."""


@dataclass(frozen=True)
class DecoderContext:
    """What a decoder may use of the assembled pipeline, handed to ``Decoder.attach`` once.

    - ``model``, ``device``, ``max_model_len``: the pipeline's model shapes, device and
      context window.
    - ``cache``: the pipeline's cache manager (a self-drafting decoder reserves, forks and
      truncates its draft slots through it).
    - ``run(items, layers=None)``: one forward over ``items`` (``ScheduledSeq``s whose slots
      the cache holds; any object with ``seq_id``, ``token_ids``, ``num_computed_tokens`` and
      ``num_pending`` serves as a sequence), returning the logits of each item's last query
      row, [len(items), vocab]; ``layers`` runs a subset of the decoder layers.
    - ``tokens_left(seq)``: tokens ``seq`` may still generate before ``max_tokens`` or the
      context window stops it (the engine's stop rule).
    - ``vocab_size``: the tokenizer's length (a draft model must match it); ``num_parameters``:
      the model's parameter count (what a draft costs relative to its target).
    - ``config``: the pipeline config as plain data (JSON types).
    - ``build_pipeline(config, overrides)``: assembles another pipeline from plain config data
      (a draft model's) and returns its context; it lives as long as the context does.
    """

    model: ModelSpec
    device: torch.device
    max_model_len: int
    cache: CacheManager
    run: Callable[[list[ScheduledSeq], Layers[int] | None], torch.Tensor]
    tokens_left: Callable[[Sequence], int]
    vocab_size: int
    num_parameters: int
    config: dict[str, Any]
    build_pipeline: Callable[[dict[str, Any], list[str]], "DecoderContext"]
    eos_token_ids: frozenset[int] = frozenset()
    """The tokenizer's and model's end-of-sequence ids (plugin API 1.12)."""
    reassign: Callable[[list[Sequence], list[int]], None] | None = None
    """``reassign(group, parents)`` (plugin API 1.12; a joint request's decoder, inside
    ``decode``): sequence ``group[j]`` becomes a copy of ``group[parents[j]]`` as it was
    before the call (its tokens, and its cache by copy-on-write sharing), then takes the
    token ``decode`` returns for its slot."""
    end_group: Callable[[list[Sequence], list[tuple[list[int], float, str]]], None] | None = None
    """``end_group(group, results)`` (plugin API 1.12; inside ``decode``): the joint request
    of ``group`` finishes with ``results``, best first, each (generated tokens, score,
    finish reason "stop" or "length"): its first ``len(results)`` sequences hold them, the
    others end without output."""


class Decoder(Plugin):
    """Turns a step's logits into tokens, proposing draft tokens first if it speculates.

    Contract:
    - ``num_lookahead_tokens``: the most draft tokens it proposes per sequence and step; the
      scheduler reserves that many extra slots.
    - ``attach(ctx)`` is called once, after every part is built, with the ``DecoderContext``:
      a speculative decoder runs draft forwards through ``ctx.run`` (layer-skip drafting) or
      builds a draft pipeline of its own (``ctx.build_pipeline``). (``bind(pipeline)``, which
      plugin API 1.0 called with the whole pipeline, still is for a decoder that overrides
      it; it is deprecated.)
    - ``check(params)`` raises ``InvalidRequestError`` for sampling parameters it cannot honor.
    - ``propose(out)`` returns seq_id -> draft tokens for the scheduled decoding sequences;
      the engine appends them to the sequence's query (plain decoders return {}). At most
      ``num_lookahead_tokens`` per sequence, and none for a sequence whose query is not its
      last uncomputed tokens or that has no output yet (the step that may fork it, n > 1).
    - ``decode(logits, batch)`` gets logits [R, vocab] (float32, or float64 in a float64 pipeline) for ``batch.logits_indices``
      and returns, for each ``batch.samples`` slot in order, the accepted tokens: exactly one
      for plain decoding, 1 to k+1 when verifying k drafts (accepted drafts, then one token
      sampled from the target). The engine keeps the KV of accepted drafts and rolls the rest
      back.
    - ``finish(seq)`` is called once when a sequence finishes or is aborted: release any
      per-sequence state (a draft model's cache, an n-gram index).
    - What it reads: each slot ``s`` of ``batch.samples`` has its sequence ``s.seq``, whose
      ``params`` are the request's ``SamplingParams`` (``params.greedy``: take the argmax)
      and whose ``generator`` draws its randomness (seeded requests repeat);
      ``slot_logits(logits, batch)`` gives each slot's row. Settings beyond
      ``SamplingParams``' fields are declared as ``RequestArgs`` and read, validated, with
      ``request_args(params)``.
    - Optional, for async scheduling: ``samples_on_device(params)`` says whether it can pick a
      request's tokens without the host, and ``device_tokens(logits, batch)`` then returns
      one token per sample slot as a device tensor (no host synchronisation), exactly the
      tokens ``decode`` would return. A decoder whose ``device_tokens`` only ranks each
      row's logits (an argmax) sets ``device_tokens_any_dtype``: it may then be handed them
      in the model's dtype (bfloat16 on a GPU), which spares a float32 copy of the batch's
      logits every step and changes no token (the conversion is exact and keeps the order).
    """

    kind: ClassVar[str] = "decoding"
    num_lookahead_tokens: int = 0
    device_tokens_any_dtype: ClassVar[bool] = False
    request_fields: ClassVar[frozenset[str] | None] = None
    """The ``DECODER_FIELDS`` this decoder honours; None: those its ``api_version`` knows.
    A decoder written for an older plugin API that honours a newer field lists it here."""
    RequestArgs: ClassVar[type[PluginOptions] | None] = None
    """The per-request settings this decoder takes from ``SamplingParams.extra_args``, as a
    ``PluginOptions`` model (typed fields with defaults; unknown keys refused). None: it
    takes none, and a request that sends any is refused."""

    def __init__(self, options: PluginOptions, model: ModelSpec, device: torch.device):
        self.options = options
        self.model = model
        self.device = device

    def attach(self, ctx: DecoderContext) -> None:
        """Take what the decoder needs of the assembled pipeline; nothing by default."""

    def sequences_per_request(self, params: SamplingParams) -> int:
        """How many sequences a request runs as once its prompt is done (plugin API 1.12):
        ``params.n`` by default; a beam search runs ``num_beams`` and returns ``n`` of them."""
        return params.n

    def joint(self, params: SamplingParams) -> bool:
        """Whether a request's sequences step together (plugin API 1.12): the engine then runs
        their sampling step only when all of them reach it, hands the decoder every one of
        them in that step, and a scheduler preempts them as one; the decoder may regroup them
        (``DecoderContext.reassign``) and end them (``end_group``). No by default."""
        return False

    def bind(self, pipeline: Any) -> None:
        """Deprecated (plugin API 1.0): take what the decoder needs from the whole pipeline.
        Override ``attach`` instead; the pipeline still calls an overriding ``bind``."""

    def check(self, params: SamplingParams) -> None:
        """Raise InvalidRequestError if ``params`` ask for what this decoder cannot do."""

    def request_args(self, params: SamplingParams) -> PluginOptions | None:
        """``params.extra_args`` validated by ``RequestArgs`` (None when it declares none).
        The engine validates when a request arrives, so a step never meets a bad one; the
        validated model is kept on ``params``."""
        if params._request_args is None and self.RequestArgs is not None:
            params._request_args = _validated_request_args(self, params)
        return params._request_args

    def validate_request_fields(self, params: SamplingParams) -> None:
        """InvalidRequestError naming the first field ``params`` set (to other than its
        default) that this decoder does not honour (``DECODER_FIELDS``, ``request_fields``)."""
        for field in unhonoured_fields(type(self), params):
            raise InvalidRequestError(
                f"decoding plugin {self.name!r} (written for plugin API {self.api_version}) does not honour "
                f"SamplingParams.{field}, added in plugin API {DECODER_FIELDS[field]}, and would ignore it; leave "
                f"{field} at {SamplingParams.model_fields[field].default!r} or choose a decoder that honours it "
                f"(its author lists it in request_fields)", field=field)

    def validate_request_args(self, params: SamplingParams) -> None:
        """InvalidRequestError naming this plugin when ``params.extra_args`` do not fit
        ``RequestArgs`` (or it declares none and some were sent)."""
        if params.extra_args and self.RequestArgs is None:
            raise InvalidRequestError(f"decoding plugin {self.name!r} takes no extra_args, but the request sends "
                                      f"{', '.join(sorted(params.extra_args))}", field="extra_args")
        self.request_args(params)

    def target_probs(self, logits: torch.Tensor, params: SamplingParams) -> torch.Tensor | None:
        """The distribution this decoder draws a token from, given one row of logits [vocab]
        (float64) and the request's parameters: probabilities [vocab] summing to 1. The
        decoding suite checks the decoder's draws against it. None (the default): the standard
        rule, which ``tessellm.testing.reference_probs`` implements (the temperature, then
        top-k, top-p and min-p, each cut applied to the distribution the previous one left).
        A sampler with a rule of its own (top-a, typical-p, mirostat) overrides this."""
        return None

    def propose(self, out: SchedulerOutput) -> dict[int, list[int]]:
        """Draft tokens per decoding sequence; none by default."""
        return {}

    def finish(self, seq: Sequence) -> None:
        """Forget ``seq``'s per-sequence state; nothing by default."""

    def samples_on_device(self, params: SamplingParams) -> bool:
        """Whether ``device_tokens`` serves requests with ``params``; no by default."""
        return False

    def device_tokens(self, logits: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
        """[len(batch.samples)] tokens on the logits' device, for requests that
        ``samples_on_device`` accepted."""
        raise NotImplementedError(f"decoding plugin {self.name!r} does not sample on the device")

    @abstractmethod
    def decode(self, logits: torch.Tensor, batch: BatchMetadata) -> list[list[int]]:
        """Accepted tokens for each sample slot of ``batch``."""


def honoured_fields(decoder: type[Decoder]) -> frozenset[str]:
    """The ``DECODER_FIELDS`` a decoder class honours: its ``request_fields``, or else the
    fields its ``api_version`` knows."""
    if decoder.request_fields is not None:
        return frozenset(decoder.request_fields)
    minor = api_minor(decoder.api_version)
    return frozenset(f for f, since in DECODER_FIELDS.items() if api_minor(since) <= minor)


def unhonoured_fields(decoder: type[Decoder], params: SamplingParams) -> list[str]:
    """The fields ``params`` sets to other than their defaults that ``decoder`` does not honour."""
    honoured = honoured_fields(decoder)
    fields = SamplingParams.model_fields
    return [f for f in DECODER_FIELDS if f not in honoured and getattr(params, f) != fields[f].default]


def _validated_request_args(decoder: Decoder, params: SamplingParams) -> PluginOptions:
    try:
        return decoder.RequestArgs.model_validate(params.extra_args)
    except ValidationError as exc:
        allowed = ", ".join(decoder.RequestArgs.model_fields) or "none"
        raise InvalidRequestError(f"decoding plugin {decoder.name!r} refuses the request's extra_args (it takes: "
                                  f"{allowed}): {validation_problems(exc, 'extra_args.')}", field="extra_args") from None


def slot_logits(logits: torch.Tensor, batch: BatchMetadata) -> torch.Tensor:
    """The logits row of each sample slot's first row, [len(batch.samples), vocab]. In a
    plain decode step that is every row in order, returned as is (no gather, no host-to-device
    index copy)."""
    first = [s.first_row for s in batch.samples]
    if len(first) == logits.shape[0] and first == list(range(len(first))):
        return logits
    return logits[torch.tensor(first, dtype=torch.long, device=logits.device)]
