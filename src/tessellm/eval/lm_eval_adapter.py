"""lm-evaluation-harness model ``tessellm``: any pipeline as an ``lm_eval`` model.

Importing this module registers the model in lm_eval's registry (lm_eval has no entry-point
discovery for models, so ``tessellm eval lm-eval ...`` imports it, then runs lm_eval's own
command line; from Python, import it before ``lm_eval.simple_evaluate(model="tessellm")``).
Model arguments: ``config`` (a pipeline config file; default: the embedded one), ``set``
(config overrides separated by ``;``, e.g. ``set=quant.name=int8-weight;cache.name=paged``)
and ``max_length`` (tokens of context; default: the pipeline's max_model_len).

``loglikelihood`` and ``loglikelihood_rolling`` score each token sequence as one teacher-forced
prefill through the whole pipeline (``Engine.score``); ``generate_until`` runs every request
of a call as one continuously batched ``LLM.generate``.
"""

from __future__ import annotations

import logging
from typing import Any

import lm_eval.models  # noqa: F401  (registers lm_eval's own models first: see get_model)
import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window
from tqdm import tqdm

from tessellm.core.engine.llm import LLM
from tessellm.core.errors import ConfigError

logger = logging.getLogger(__name__)

DEFAULT_MAX_GEN_TOKS = 256
HARNESS_ARGS = ("batch_size", "max_batch_size", "device")
"""Arguments lm_eval passes every model; the pipeline batches continuously and its config
chooses the device, so these are accepted and ignored."""


@register_model("tessellm")
class TessellmLM(TemplateLM):
    """A tessellm pipeline answering lm_eval's three request types. Scores are exact
    teacher-forced log-probabilities (float64 sums); generation is greedy unless the task's
    ``gen_kwargs`` ask for sampling."""

    def __init__(self, config: str | None = None, set: str | None = None, max_length: int | None = None,
                 llm: LLM | None = None, **ignored: Any):
        super().__init__()
        unknown = sorted(k for k, v in ignored.items() if v is not None and k not in HARNESS_ARGS)
        if unknown:  # before a model loads
            raise ConfigError(f"tessellm model_args take config, set and max_length; unknown: {', '.join(unknown)}")
        if max_length is not None and (isinstance(max_length, bool) or not str(max_length).isdigit()):
            raise ConfigError(f"tessellm model_args max_length must be a whole number of tokens, got {max_length!r}")
        overrides = [s.strip() for s in (set or "").split(";") if s.strip()]
        self.llm = llm or LLM(config, overrides=overrides)
        self.tokenizer = self.llm.tokenizer
        limit = self.llm.engine.max_model_len
        if max_length is not None and not 2 <= int(max_length) <= limit:
            raise ConfigError(f"tessellm model_args max_length must be in 2..{limit} (max_model_len), got {max_length}")
        self._max_length = int(max_length or limit)

    # ---------------------------------------------------------------- tokens

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def tokenizer_name(self) -> str:
        return getattr(self.tokenizer, "name_or_path", "tessellm").replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
        if add_special_tokens is None:
            return self.tokenizer(string)["input_ids"]
        return self.tokenizer(string, add_special_tokens=add_special_tokens)["input_ids"]

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(chat_history, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    # ---------------------------------------------------------------- scoring

    def _continuation_logprob(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """(log P(continuation | context), whether greedy decoding would produce it), with
        the context cut from the left to fit max_length."""
        if not continuation:
            return 0.0, True
        whole = (context + continuation)[-(self.max_length + 1):]
        logits = self.llm.engine.score(whole[:-1])
        logprobs = logits[-len(continuation):].double().log_softmax(-1)
        target = torch.tensor(continuation, device=logprobs.device)
        total = logprobs.gather(1, target[:, None]).sum().item()
        return total, bool((logprobs.argmax(-1) == target).all())

    def _loglikelihood_tokens(self, requests: list, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        results = []
        for cache_key, context, continuation in tqdm(requests, desc="tessellm loglikelihood", disable=disable_tqdm):
            result = self._continuation_logprob(context, continuation)
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
        results = []
        for (text,) in tqdm([r.args for r in requests], desc="tessellm loglikelihood_rolling", disable=disable_tqdm):
            windows = [make_disjoint_window(w) for w in get_rolling_token_windows(
                self.tok_encode(text, add_special_tokens=False), self.prefix_token_id, self.max_length, 1)]
            total = sum(self._continuation_logprob(ctx, cont)[0] for ctx, cont in windows)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            results.append(total)
        return results

    # ---------------------------------------------------------------- generation

    def _sampling(self, gen_kwargs: dict[str, Any]) -> dict[str, Any]:
        kwargs = dict(gen_kwargs)
        until = kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        params: dict[str, Any] = {"stop": until, "max_tokens": int(kwargs.pop("max_gen_toks", DEFAULT_MAX_GEN_TOKS))}
        do_sample = kwargs.pop("do_sample", None)
        temperature = float(kwargs.pop("temperature", 0.0) or 0.0)
        params["temperature"] = temperature if do_sample is not False else 0.0
        for name in ("top_p", "top_k", "min_p", "seed"):
            if name in kwargs:
                params[name] = kwargs.pop(name)
        if kwargs:
            logger.warning("tessellm: gen_kwargs %s are not supported and are ignored", sorted(kwargs))
        return params

    def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
        prompts, params = [], []
        for context, gen_kwargs in [r.args for r in requests]:
            p = self._sampling(gen_kwargs)
            room = self.max_length - p["max_tokens"]
            if room < 1:
                raise ConfigError(f"max_gen_toks {p['max_tokens']} leaves no room for context in max_length "
                                  f"{self.max_length}")
            prompts.append(self.tok_encode(context)[-room:])
            params.append(p)
        if not prompts:
            return []
        outputs = self.llm.generate(prompts, params, progress=not disable_tqdm)
        texts = [o.text for o in outputs]
        for (context, gen_kwargs), text in zip([r.args for r in requests], texts):
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return texts
