"""Tensor parallelism for transformers' models, along the plan the model declares.

A transformers config names how its base model splits over ranks (``base_model_tp_plan``:
``layers.*.self_attn.q_proj`` colwise, ``o_proj`` rowwise, ...). tessellm's shard rules
(core/parallel/shard.py) split the same modules the same way, by name: query heads with
their KV heads, MLP columns. So a rank reads its slices as for a native model, builds the
model with its own head counts and MLP width, and sums each row-parallel module's output
over the ranks (a forward hook). A model that declares no plan is refused; so is one whose
plan splits a module other than core's rules do (a module the plan splits and the rules
keep whole is computed whole on every rank: slower, still exact)."""

from __future__ import annotations

import copy
import re
from typing import Any

from tessellm.core.errors import ConfigError

COLUMN, ROW = ("colwise", "local_colwise", "packed_colwise"), ("rowwise", "local_rowwise", "packed_rowwise")


def tp_plan(config: Any) -> dict[str, str]:
    """The model's tensor-parallel plan, patterns over module paths from the model's root."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    plan = getattr(text, "base_model_tp_plan", None) or {}
    return {f"model.{pattern}": style for pattern, style in plan.items()}


def planned_style(module_path: str, plan: dict[str, str]) -> str | None:
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), module_path):
            return style
    return None


def check_rule(name: str, rule: Any, plan: dict[str, str], model_type: str) -> None:
    """A ConfigError where core's rule for parameter ``name`` splits it unlike the plan."""
    if not plan:
        raise ConfigError(f"parallel.tensor: model plugin 'transformers' splits a model along the tensor-parallel "
                          f"plan its config declares, and this {model_type!r} config declares none "
                          f"(base_model_tp_plan); set parallel.tensor=1")
    if rule is None:
        return  # kept whole on every rank: exact whatever the plan says
    module = name.rsplit(".", 1)[0]
    style = planned_style(module, plan)
    dim = rule[0] if isinstance(rule, tuple) else None
    wanted = COLUMN if dim == 0 else ROW if (dim == 1 or rule == "zero") else ()
    if style not in wanted:
        raise ConfigError(f"parallel.tensor: {model_type!r} module {module!r} is planned {style or 'whole'!r}, but "
                          f"tessellm's shard rules split it {'by columns' if dim == 0 else 'by rows'}; set "
                          f"parallel.tensor=1")


def local_config(config: Any, spec: Any) -> Any:
    """A copy of ``config`` whose text model has one rank's heads and MLP width (``spec``,
    the rank's ModelSpec), its head size pinned."""
    config = copy.deepcopy(config)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    text.num_attention_heads, text.num_key_value_heads = spec.num_heads, spec.num_kv_heads
    text.head_dim, text.intermediate_size = spec.head_dim, spec.intermediate_size
    return config

