"""What happens to a step's tokens: the stop rule and the log-probabilities a request asks
for. Every stop condition lives in ``StopRule``.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from tessellm.core.interfaces.batch import BatchMetadata
from tessellm.core.interfaces.sequence import FinishReason, Sequence, TokenLogprob


class StopRule:
    """When a sequence stops generating.

    After each appended token, in order: the tokenizer's EOS (unless ``ignore_eos``) or one
    of the request's ``stop_token_ids``; a stop string in the output text (``stop_text_len``
    is set where the first begins); ``max_tokens`` generated, or the context window
    (``max_model_len``) full. EOS, stop ids and stop strings count only once ``min_tokens``
    tokens are out; until then the ``min_tokens`` logits processor bars the decoder from
    picking EOS or a stop id, so the output never holds one early.

    Lengths count tokens still on the device (async scheduling: ``Sequence.num_pending``), so
    the same rule tells whether a token about to be launched will surely be the last.
    """

    def __init__(self, eos_token_ids: Iterable[int], max_model_len: int,
                 decode_text: Callable[[list[int]], str] | None = None):
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_model_len = max_model_len
        self.decode_text = decode_text

    def tokens_left(self, seq: Sequence) -> int:
        """Tokens ``seq`` may still generate before ``max_tokens`` or the context window
        stops it (pending tokens counted)."""
        length = len(seq.token_ids) + seq.num_pending
        return min(seq.params.max_tokens - (length - seq.num_prompt_tokens), self.max_model_len - length)

    def continuing(self, seqs: list[Sequence]) -> list[Sequence]:
        """The sequences among ``seqs`` that one more token leaves running by length: those
        whose coming token is not surely their last (one pass: hundreds of sequences a step)."""
        limit = self.max_model_len - 1
        out = []
        for seq in seqs:
            length = len(seq.token_ids) + seq.num_pending + 1  # with the coming token
            if length - seq.num_prompt_tokens < seq.params.max_tokens and length <= limit:
                out.append(seq)
        return out

    def check(self, seq: Sequence, token: int) -> FinishReason | None:
        """Why ``seq`` stops now that ``token`` was appended to it, or None."""
        params = seq.params
        length = len(seq.token_ids)
        if length - seq.num_prompt_tokens >= params.min_tokens:
            if (token in self.eos_token_ids and not params.ignore_eos) or token in params.stop_token_ids:
                return FinishReason.STOP
            if params.stop and self.decode_text is not None and self._hit_stop_string(seq):
                return FinishReason.STOP
        length += seq.num_pending
        if length - seq.num_prompt_tokens >= params.max_tokens or length >= self.max_model_len:
            return FinishReason.LENGTH
        return None

    def _hit_stop_string(self, seq: Sequence) -> bool:
        """Whether the output now contains a stop string (``stop_text_len``: where the first
        begins). Checked after every token, so only an occurrence ending in the newest
        token's text is new: it lies within the last few tokens, and only those are decoded
        (a token is at least a quarter of a character; 8 tokens of margin keep the window's
        own start, where decoding a suffix may differ, out of play). The whole output is
        decoded only to place a hit. Under ``min_tokens`` only an occurrence that ends in the
        text of the ``min_tokens``-th token or later counts (the check starts with that token,
        so an earlier one never stopped the output and cannot cut it now)."""
        stops = [s for s in seq.params.stop if s]
        output = seq.output_token_ids
        window = 4 * max((len(s) for s in stops), default=0) + 8
        if len(output) > window and not any(s in self.decode_text(output[-window:]) for s in stops):
            return False
        text = self.decode_text(output)
        floor = len(self.decode_text(output[:seq.params.min_tokens - 1])) if seq.params.min_tokens > 1 else 0
        hits = [at for s in stops if (at := text.find(s, max(0, floor - len(s) + 1))) >= 0]
        if hits:
            seq.stop_text_len = min(hits)
            return True
        return False


def _scored_rows(logits: torch.Tensor, rows: list[int], chosen: list[int], top_n: int) -> list[list[Any]]:
    """Per row of ``logits[rows]``: the log-probability of its ``chosen`` token and the
    ``top_n`` most likely (id, log-probability) pairs, from one batched log-softmax over the
    model's own distribution (float32, or float64 in a float64 pipeline)."""
    device = logits.device
    picked_rows = logits.index_select(0, torch.tensor(rows, dtype=torch.long, device=device))
    lp = torch.log_softmax(picked_rows if picked_rows.dtype == torch.float64 else picked_rows.float(), dim=-1)
    picked = lp.gather(1, torch.tensor(chosen, dtype=torch.long, device=device)[:, None])[:, 0].tolist()
    if not top_n:
        return [[value, []] for value in picked]
    top = lp.topk(top_n, dim=-1)
    return [[value, list(zip(ids, values))] for value, ids, values in
            zip(picked, top.indices.tolist(), top.values.tolist())]


def record_prompt_logprobs(logits: torch.Tensor, batch: BatchMetadata) -> None:
    """Append to each scored sequence's ``prompt_logprobs`` the log-probability of every
    prompt token its ``batch.prompt_rows`` predict, with the top alternatives. A position
    already recorded (the prompt recomputed after a preemption) is not recorded again."""
    rows = [r for p in batch.prompt_rows for r in range(p.first_row, p.first_row + p.num_rows)]
    targets = [t for p in batch.prompt_rows
               for t in p.seq.token_ids[p.first_position + 1:p.first_position + 1 + p.num_rows]]
    scored = iter(_scored_rows(logits, rows, targets, max(p.seq.params.prompt_logprobs for p in batch.prompt_rows)))
    for p in batch.prompt_rows:
        seq, n = p.seq, p.seq.params.prompt_logprobs
        if not seq.prompt_logprobs:
            seq.prompt_logprobs.append(None)  # the first token: nothing predicts it
        for position in range(p.first_position, p.first_position + p.num_rows):
            value, top = next(scored)
            if position + 1 == len(seq.prompt_logprobs):
                seq.prompt_logprobs.append(TokenLogprob(value, top[:n]))


def token_logprobs(logits: torch.Tensor, batch: BatchMetadata,
                   tokens: list[list[int]]) -> list[list[TokenLogprob] | None]:
    """For each sample slot whose request asks for logprobs, each accepted token's
    log-probability under the row that produced it and the top alternatives (one batched
    log-softmax over the model's own distribution); None for the other slots."""
    want = [i for i, s in enumerate(batch.samples) if s.seq.params.logprobs is not None]
    out: list[list[TokenLogprob] | None] = [None] * len(batch.samples)
    if not want:
        return out
    rows = [batch.samples[i].first_row + j for i in want for j in range(len(tokens[i]))]
    scored = iter(_scored_rows(logits, rows, [t for i in want for t in tokens[i]],
                               max(batch.samples[i].seq.params.logprobs for i in want)))
    for i in want:
        n = batch.samples[i].seq.params.logprobs
        # the tokens first: zip then stops without taking one more row
        out[i] = [TokenLogprob(value, top[:n]) for _, (value, top) in zip(tokens[i], scored)]
    return out
