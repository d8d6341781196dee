"""Exact verification of draft tokens (Leviathan et al. 2023; Chen et al. 2023).

Given the target's distributions p_0..p_n at the n+1 verified positions and the draft's
q_1..q_n that produced drafts x_1..x_n, accept x_i with probability min(1, p(x_i) / q(x_i));
at the first rejection emit a token drawn from norm(max(0, p - q)) and stop; if every draft
is accepted, emit a bonus token drawn from p_n. Each emitted token is then distributed
exactly as the target would have sampled it. A deterministic proposer (n-gram lookup) is
the case q = one-hot(x_i): accept with probability p(x_i), else draw from p without x_i.
Greedy requests accept a draft exactly when it is the target's argmax.
"""

from __future__ import annotations

import torch


def residual(p: torch.Tensor, q: torch.Tensor | None, rejected: int) -> torch.Tensor:
    """The distribution to resample from after rejecting draft token ``rejected``:
    max(0, p - q) (unnormalised; ``q`` None means a one-hot draft at ``rejected``)."""
    if q is None:
        out = p.clone()
        out[rejected] = 0.0
        return out
    return (p - q).clamp_min(0.0)


def accept_greedy(target_tokens: list[int], draft: list[int]) -> list[int]:
    """``target_tokens`` are the target's argmax at the n+1 positions: keep drafts while they
    match it, then the target's own token (the correction, or the bonus after all n)."""
    out: list[int] = []
    for i, x in enumerate(draft):
        if x != target_tokens[i]:
            break
        out.append(x)
    out.append(target_tokens[len(out)])
    return out


def accept_sampled(p: torch.Tensor, draft: list[int], q: torch.Tensor | None,
                   generator: torch.Generator | None) -> list[int]:
    """Rejection sampling of ``draft`` against the target distributions.

    p [n+1, V] (each row sums to 1), q [n, V] or None (one-hot drafts), all on the CPU.
    Returns 1 to n+1 tokens. Uses one uniform per draft examined and one categorical draw,
    so a request's seeded generator gives reproducible tokens.
    """
    out: list[int] = []
    for i, x in enumerate(draft):
        px = float(p[i, x])
        qx = 1.0 if q is None else float(q[i, x])
        u = float(torch.rand((), generator=generator, dtype=torch.float64))
        if u * qx < px:  # u < p/q without dividing; q(x) > 0 since x was drawn from q
            out.append(x)
            continue
        rest = residual(p[i], None if q is None else q[i], x)
        if not float(rest.sum()) > 0.0:  # p == q up to rounding: acceptance was certain in exact arithmetic
            rest = p[i]
        out.append(int(torch.multinomial(rest, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(p[len(draft)], 1, generator=generator)))
    return out
