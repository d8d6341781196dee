"""Helpers for testing tessellm plugins, built-in and third-party: plain-torch references
and random inputs a plugin's output can be compared against.

``reference_probs`` is the standard sampling rule every decoder is held to unless it
declares its own (``Decoder.target_probs``)."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["reference_probs"]


def reference_probs(logits: torch.Tensor, params: Any = None, /, **settings: Any) -> torch.Tensor:
    """The distribution [V] (float64, summing to 1) a request asks for from one row of logits
    [V], by the standard rule: scale by the temperature, then top_k keeps the k most likely
    tokens (0: all), top_p the smallest set of those (renormalised) whose mass reaches p, and
    min_p the tokens at least min_p times as likely as the most likely one. Temperature 0 is
    greedy: all the mass on the argmax.

    ``params`` is a ``SamplingParams`` (or None); keyword ``settings`` (temperature, top_k,
    top_p, min_p) override its fields: ``reference_probs(logits, temperature=0.7, top_k=4)``.
    Settings beyond these (a plugin's ``extra_args``) play no part in the standard rule."""
    rule = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0}
    if params is not None:
        rule.update({k: getattr(params, k) for k in rule if hasattr(params, k)})
    unknown = set(settings) - set(rule) - {"extra_args"}
    if unknown:
        raise TypeError(f"reference_probs takes {', '.join(rule)}; not {', '.join(sorted(unknown))}")
    rule.update({k: v for k, v in settings.items() if k in rule})
    logits = logits.double()
    if rule["temperature"] == 0:
        return torch.nn.functional.one_hot(logits.argmax(), logits.numel()).double()
    probs = (logits / rule["temperature"]).softmax(dim=-1)
    order = probs.argsort(descending=True)
    keep = torch.ones_like(probs, dtype=torch.bool)
    if rule["top_k"] > 0:
        keep[order[rule["top_k"]:]] = False
    ranked = torch.where(keep, probs, 0.0)[order]
    ranked = ranked / ranked.sum()
    before = ranked.cumsum(0) - ranked  # mass of the kept tokens ranked above each one
    cut = before >= rule["top_p"]
    cut[0] = False  # the most likely token always stays
    keep[order[cut]] = False
    if rule["min_p"] > 0:
        keep &= probs >= rule["min_p"] * probs.max()
    out = torch.where(keep, probs, 0.0)
    return out / out.sum()
