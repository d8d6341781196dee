"""Building blocks for testing a logits processor by hand: a context, sequences with an
output, and rows laid out as the engine plans a speculative verification step."""

from __future__ import annotations

from typing import Any, Callable

import torch

from tessellm.core.interfaces.logits import ProcessorContext, ProcessorRows
from tessellm.core.interfaces.sequence import SamplingParams, Sequence

CPU = torch.device("cpu")


def processor_context(vocab: int, encode: Callable[[str], list[int]] = lambda text: [],
                      eos: frozenset[int] = frozenset({0})) -> ProcessorContext:
    """A CPU context of ``vocab`` logits columns, the end-of-sequence ids ``eos`` and the
    tokenizer ``encode``."""
    return ProcessorContext(vocab_size=vocab, device=CPU, eos_token_ids=eos, encode=encode, max_model_len=4096)


def sequence(prompt: list[int], output: list[int], **params: Any) -> Sequence:
    """A sequence whose prompt is ``prompt`` and which has generated ``output``."""
    seq = Sequence("req", prompt, SamplingParams(**params))
    seq.token_ids.extend(output)
    return seq


def verification_rows(entries: list[tuple[Sequence, Any, tuple[int, ...]]]) -> ProcessorRows:
    """Rows as the engine plans them: each (seq, args, drafts) gets one row per draft prefix
    (row j follows drafts[:j]); rows sit at odd indices, so the even ones must stay untouched."""
    rows, seqs, args, drafts, outputs = [], [], [], [], []
    for seq, a, d in entries:
        for j in range(len(d) + 1):
            rows.append(2 * len(rows) + 1)
            seqs.append(seq)
            args.append(a)
            drafts.append(tuple(d[:j]))
            outputs.append(seq.num_output_tokens + j)
    return ProcessorRows(rows, seqs, args, drafts, outputs, index=torch.tensor(rows))


def added_rows(proc: Any, histories: list[tuple[list[int], list[int], tuple[int, ...], dict[str, Any]]]) -> ProcessorRows:
    """``proc`` with a sequence added per (prompt, output, drafts, sampling params), under the
    arguments those params give it; the rows of a step verifying each one's drafts."""
    entries = []
    for prompt, output, drafts, params in histories:
        seq = sequence(prompt, output, **params)
        args = proc.request_args(seq.params)
        proc.add(seq, args)
        entries.append((seq, args, drafts))
    return verification_rows(entries)
