"""Every causal-LM family of the installed transformers, through the ``transformers`` model
plugin: a tiny random checkpoint of each (transformers' own config and model classes, shapes
shrunk generically), greedy tokens through a tessellm pipeline, and transformers' own
``generate`` on the same checkpoint for reference.

Each family ends in one of five states: ``served`` (the tokens equal the reference's, or
first differ at a near-tie of its two best logits, or equal transformers' greedy tokens
recomputed without a cache where its cached generate departs from its own forward),
``differs`` (wrong text: a bug),
``fails`` (served, then raised: a bug),
``declined`` (the plugin refused it, saying why) or ``not built`` (no tiny checkpoint of it
could be made or run by transformers itself: not a decoder-only language model, or the
generic shrinking does not fit it). ``python -m tessellm.testing.transformers_families``
walks them all and writes the table docs/model_families.md commits.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import re
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

TEXT_SHRINK: dict[str, Any] = dict(
    hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16, vocab_size=512, max_position_embeddings=512, moe_intermediate_size=32, num_experts=4,
    num_local_experts=4, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
    shared_expert_intermediate_size=32, kv_lora_rank=32, q_lora_rank=48, qk_rope_head_dim=16, qk_nope_head_dim=16,
    v_head_dim=24, n_group=1, topk_group=1, first_k_dense_replace=1, num_key_value_groups=None)
"""Sizes every family's text config gets where it has the field."""
VISION_SHRINK: dict[str, Any] = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                     depth=1, embed_dim=32, num_heads=2)
"""Sizes a multimodal family's other sub-configs get (its vision or audio tower is built,
not run: prompts are text)."""
FAMILY_FIELDS: dict[str, dict[str, Any]] = {
    # what the generic shrinking gets wrong, or leaves out of a family's character
    "codegen": dict(rotary_dim=8), "gptj": dict(rotary_dim=8),
    "lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "bamba": dict(attn_layer_indices=[1, 3]),
}
"""Per family, config fields on top of the shrunk sizes."""
MAX_PARAMETERS = 16_000_000
SPECIAL_IDS = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 8
"""A sliding window shorter than the prompts, so windows bind."""


@dataclass(frozen=True)
class FamilyResult:
    model_type: str
    state: str  # served, differs, fails, declined, not built
    detail: str = ""

    def row(self) -> str:
        """The family's line of docs/model_families.md: its type, the native plugin that
        serves it under ``auto`` (if any), the transformers plugin's state and its detail."""
        native = ", ".join(f"`{n}`" for n in native_plugins().get(self.model_type, [])) or "-"
        return f"| `{self.model_type}` | {native} | {self.state} | {self.detail.replace('|', '/')} |"


def native_plugins() -> dict[str, list[str]]:
    """model_type -> the model plugins declaring it (the transformers plugin declares none)."""
    from tessellm.core.registry import get_registry

    return get_registry().model_types()


def causal_lm_types() -> list[str]:
    """Every model_type transformers maps to a causal-LM class."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def tiny_config(model_type: str) -> Any:
    """The family's default config with ``TEXT_SHRINK`` sizes (and ``VISION_SHRINK`` on its
    other sub-configs) where it has those fields, a window of ``WINDOW`` where it slides."""
    from transformers import AutoConfig

    from tessellm.testing.models import TINY_SHAPES

    if model_type in TINY_SHAPES:  # the shapes tessellm's own tests use for the families it runs natively
        return AutoConfig.for_model(model_type, vocab_size=512, **SPECIAL_IDS, **TINY_SHAPES[model_type])
    default = AutoConfig.for_model(model_type)
    text = default.get_text_config()
    overrides = _shrunk(text, TEXT_SHRINK)
    overrides.update(_per_layer_lists(text, overrides.get("num_hidden_layers")))
    if getattr(text, "sliding_window", None):
        overrides["sliding_window"] = WINDOW
    overrides.update({k: v for k, v in SPECIAL_IDS.items() if hasattr(text, k)})
    overrides.update(FAMILY_FIELDS.get(model_type, {}))
    if text is default:
        return AutoConfig.for_model(model_type, **overrides)
    subs: dict[str, Any] = {}
    for key in getattr(default, "sub_configs", {}) or {}:
        sub = getattr(default, key, None)
        if sub is None:
            continue
        subs[key] = {**sub.to_dict(), **(overrides if sub is text else _shrunk(sub, VISION_SHRINK))}
    return AutoConfig.for_model(model_type, **subs)


def _shrunk(config: Any, sizes: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in sizes.items() if v is not None and getattr(config, k, None) is not None}


def _per_layer_lists(config: Any, layers: int | None) -> dict[str, list]:
    """The config's per-layer lists (``layer_types`` and the like: as long as its layers)
    resampled to ``layers`` entries, every kind of entry kept (the last ones replaced by any
    kind the even sampling missed)."""
    total = getattr(config, "num_hidden_layers", None)
    if not layers or not total:
        return {}
    lists = {}
    for name, value in config.to_dict().items():
        if isinstance(value, list) and len(value) == total and name != "num_hidden_layers":
            sample = [value[i * total // layers] for i in range(layers)]
            missing = [v for v in dict.fromkeys(map(repr, value)) if v not in map(repr, sample)]
            for i, kind in enumerate(missing[:layers]):
                sample[layers - 1 - i] = next(v for v in value if repr(v) == kind)
            lists[name] = sample
    return lists


def build_family(model_type: str, folder: Path, seed: int = 0) -> Path:
    """A tiny random checkpoint of ``model_type`` (``tiny_config``) in ``folder``, weights
    drawn as ``tessellm.testing.models`` draws them, with a word-level tokenizer."""
    from transformers import AutoModelForCausalLM

    from tessellm.testing.models import _save_random

    config = tiny_config(model_type)
    with torch.device("meta"):
        size = sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())
    if size > MAX_PARAMETERS:
        raise ValueError(f"the generic shrinking leaves {size / 1e6:.0f}M parameters (a tiny checkpoint has at "
                         f"most {MAX_PARAMETERS / 1e6:.0f}M)")
    vocab = config.get_text_config().vocab_size
    return _save_random(lambda: AutoModelForCausalLM.from_config(config), folder, seed, 0.15, vocab)


PROMPTS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [3, 4, 9], list(range(20, 44)))
NEW_TOKENS = 6


def check_family(model_type: str, workdir: Path) -> FamilyResult:
    """Build, serve and compare one family (see the module's docstring for the states)."""
    from tessellm.core.errors import ModelLoadError

    try:
        folder = build_family(model_type, workdir / model_type)
        reference = _reference(folder)
        vocab = reference.config.get_text_config().vocab_size
        prompts = [[t % vocab for t in p] for p in PROMPTS]
        expected = [_generate(reference, p) for p in prompts]
    except Exception as exc:  # transformers itself cannot make or run it at these shapes
        return FamilyResult(model_type, "not built", _one_line(exc))
    try:
        llm = _pipeline(folder)
    except ModelLoadError as exc:
        return FamilyResult(model_type, "declined", re.sub(r"^model plugin 'transformers' cannot serve model_type "
                                                           r"'[^']*': ", "", _one_line(exc, with_type=False)))
    except Exception as exc:  # any other error building a pipeline on it: a bug
        return FamilyResult(model_type, "fails", _one_line(exc))
    try:
        outputs = [o.token_ids for o in llm.generate(prompts, {"max_tokens": NEW_TOKENS, "ignore_eos": True,
                                                                "temperature": 0.0})]
    except Exception as exc:  # served, then broke: a bug
        return FamilyResult(model_type, "fails", _one_line(exc))
    uncached = False
    for prompt, ours, theirs in zip(prompts, outputs, expected):
        if ours == theirs or _near_tie(reference, prompt, ours, theirs):
            continue
        if ours != _recomputed(reference, prompt):
            return FamilyResult(model_type, "differs", f"prompt of {len(prompt)}: ours {ours}, transformers {theirs}")
        uncached = True
    detail = _served_detail(llm)
    if uncached:
        detail += ("; equal to transformers' forward over the whole sequence, which its cached generate is not "
                   "(its cache keeps a window its attention mask does not apply)")
    return FamilyResult(model_type, "served", detail)


def _reference(folder: Path) -> Any:
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, experts_implementation="eager")
    except (TypeError, ValueError):
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return model.eval()


def _generate(model: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy generate, ``NEW_TOKENS`` tokens past any EOS (as ignore_eos)."""
    from transformers import GenerationConfig

    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    return out[0, len(prompt):].tolist()


def _recomputed(model: Any, prompt: list[int]) -> list[int]:
    """transformers' greedy tokens with no cache: each one from a forward over the whole
    sequence so far (the model's attention as its mask defines it, whatever its cache keeps)."""
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            tokens.append(int(model(torch.tensor([tokens]), use_cache=False).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def _near_tie(model: Any, prompt: list[int], ours: list[int], theirs: list[int]) -> bool:
    """Whether the first difference is at a near-tie of the reference's two best logits."""
    at = next((i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b), None)
    if at is None:
        return False
    with torch.no_grad():
        logits = model(torch.tensor([prompt + theirs[:at]])).logits[0, -1]
    return (logits[theirs[at]] - logits[ours[at]]).abs().item() <= 1e-4 * max(1.0, logits.abs().max().item())


def _pipeline(folder: Path) -> Any:
    from tessellm import LLM
    from tessellm.core.engine.pipeline import Pipeline

    config = {"model": str(folder), "device": "cpu", "dtype": "float32", "architecture": {"name": "transformers"},
              "cache": {"name": "paged", "options": {"block_size": 8}}}
    return LLM(pipeline=Pipeline.from_config(config))


def _served_detail(llm: Any) -> str:
    spec = llm.pipeline.spec
    features = ", ".join(sorted(spec.attention_features())) or "causal attention"
    return f"{features}; {spec.num_heads}/{spec.num_kv_heads} heads of {spec.head_dim}"


def _one_line(exc: BaseException, with_type: bool = True) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return (f"{type(exc).__name__}: {text}" if with_type else text)[:300]


def walk(model_types: list[str] | None = None) -> Iterator[FamilyResult]:
    """``check_family`` for each type (default: every causal-LM type), quietly."""
    with tempfile.TemporaryDirectory(prefix="tessellm-families-") as tmp, _quiet():
        for model_type in model_types or causal_lm_types():
            yield check_family(model_type, Path(tmp))
            gc.collect()  # one family's pipeline and reference before the next's


@contextlib.contextmanager
def _quiet():
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(previous)
        hf_logging.set_verbosity(level)
        hf_logging.enable_progress_bar()


TABLE_HEADER = """\
| model_type | native plugin | `transformers` plugin | detail |
|---|---|---|---|"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_types", nargs="*", help="families to walk (default: all)")
    parser.add_argument("--write", metavar="FILE", help="replace the table in FILE (docs/model_families.md) "
                                                        "with the rows walked")
    args = parser.parse_args(argv)
    rows = []
    for result in walk(args.model_types or None):
        print(result.row(), flush=True)
        rows.append(result.row())
    if args.write:
        write_table(Path(args.write), rows)
    return 0


def write_table(path: Path, rows: list[str]) -> None:
    """Put ``rows`` under ``TABLE_HEADER`` in ``path``, in place of the table there (the text
    around it kept)."""
    lines = path.read_text().splitlines()
    start = lines.index(TABLE_HEADER.splitlines()[0])
    end = start + 2
    while end < len(lines) and lines[end].startswith("| `"):
        end += 1
    path.write_text("\n".join(lines[:start] + TABLE_HEADER.splitlines() + rows + lines[end:]) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
