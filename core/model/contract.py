"""Checking a plugin's first call against its interface's contract, so a broken plugin is
reported in one line naming it (and its module) when it is first used, rather than as a
shape error deep inside the model or a chained traceback without its name."""

from __future__ import annotations

from typing import Callable

import torch

from tessellm.core.errors import PluginCallError, TessellmError
from tessellm.core.plugin import Plugin


def describe(plugin: Plugin) -> str:
    """'attention plugin 'x' (module m)': how an error names a plugin."""
    cls = type(plugin)
    return f"{cls.kind} plugin {cls.name!r} (module {cls.__module__})"


def checked_call(plugin: Plugin, method: str, q: torch.Tensor, call: Callable[[], torch.Tensor],
                 shape: tuple[int, ...] | None = None) -> torch.Tensor:
    """``call()``, an attention backend's ``method`` on queries ``q``; a PluginCallError naming
    the plugin if it raises or returns other than ``shape`` (default q's, [T, num_heads,
    head_dim]) in q's dtype. Errors of tessellm's own and running out of GPU memory pass
    through unchanged."""
    try:
        out = call()
    except (TessellmError, torch.cuda.OutOfMemoryError):
        raise
    except Exception as exc:
        raise PluginCallError(f"{describe(plugin)}: {method} raised {type(exc).__name__}: {exc}") from exc
    want = tuple(q.shape) if shape is None else tuple(shape)
    if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != q.dtype:
        got = f"{tuple(out.shape)} {out.dtype}" if isinstance(out, torch.Tensor) else type(out).__name__
        what = "q's shape and dtype, " if shape is None else "the queries' dtype in shape "
        raise PluginCallError(f"{describe(plugin)}: {method} returned {got}; the contract is {what}{want} {q.dtype} "
                              f"([tokens, num_heads, {'head_dim' if shape is None else 'v_head_dim'}])")
    return out
