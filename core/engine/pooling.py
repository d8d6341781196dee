"""The engine of a pooling pipeline (embeddings and scores): ``Engine``'s step, with the
decoder's part replaced by the pooler's.

A request is its prompt, prefilled under continuous batching (chunked where the scheduler
chunks it) and never decoded: the step's forward returns the final hidden states of the rows
the pooler reads (``Pooler.rows``: a sequence's first, last or every one), the engine keeps a
sequence's rows across its chunks, and once its last chunk has run the pooler turns them into
the request's output (``RequestState.pooled``) and the request finishes, its blocks freed.
Everything else (scheduling, the cache, prefix caching, fault isolation, aborts) is
``Engine``'s own. Three rules keep the output equal to the whole prompt run at once:

- an encoder's layers attend both ways, so its prompt runs in one step: a chunk that would
  cut it is held back until a step has room for all of it (its slots stay reserved), and a
  prompt longer than a step's token budget is refused at admission;
- a sequence whose pooled rows a cached prefix would skip (an encoder's, whose K/V depends on
  later tokens; a pooler reading the first or every row) carries a cache salt of its own, so
  no prefix cache of any plugin shares blocks with it; a last-token pooler over a causal
  model reuses prefixes as generation does;
- a pooled prompt generates nothing: it may fill the whole context window (the pipeline
  gives the scheduler and cache one token of room more than ``max_input_len``).
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tessellm.core.engine.engine import Engine, LaunchedStep
from tessellm.core.engine.request import RequestState
from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.batch import BatchMetadata, SchedulerOutput
from tessellm.core.interfaces.pooling import Pooler, PoolingParams
from tessellm.core.interfaces.sequence import FinishReason, SamplingParams, Sequence


@dataclass
class PooledRequest:
    """A pooling request's part the engine keeps per sequence: its parameters, its token type
    ids (an encoder's segments; None: all 0), where its pooled rows start (``skip``: a prompt
    sentence-transformers leaves out of pooling) and the rows gathered so far, by position."""

    params: PoolingParams
    token_type_ids: list[int] | None = None
    skip: int = 0
    rows: list[tuple[int, torch.Tensor]] = field(default_factory=list)


class PoolingEngine(Engine):
    """``Engine`` for a pipeline with a ``Pooler``: ``add_request`` takes ``PoolingParams``
    (``SamplingParams`` are refused, naming what the pipeline serves) and a finished request's
    ``RequestState.pooled`` holds its output."""

    def __init__(self, *args: Any, pooler: Pooler, max_input_len: int, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.pooler = pooler
        self.max_input_len = max_input_len
        """The longest prompt a request may have (the pipeline's max_model_len)."""
        self.bidirectional = self.runner.spec.bidirectional
        self._pooled: dict[int, PooledRequest] = {}  # seq_id -> its pooling request
        self._salts = itertools.count()

    def serves(self) -> str:
        """What this pipeline computes, for messages."""
        what = "embeds texts" if self.pooler.task == "embed" else "scores (query, document) pairs"
        return f"this pipeline {what} (pooling plugin {self.pooler.name!r}); it does not generate text"

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: Any, *, priority: int = 0,
                    cache_salt: str | None = None, lora: str | None = None,
                    token_type_ids: list[int] | None = None, skip: int = 0,
                    images: Any = None) -> RequestState:
        """Admit a pooling request (``params``: ``PoolingParams``); ``token_type_ids``, one per
        prompt token, for an encoder that reads segments; ``skip``: leading tokens left out of
        the pooled rows. ``images`` are refused: a pooling pipeline embeds or scores text."""
        if not isinstance(params, PoolingParams):
            raise InvalidRequestError(f"{self.serves()}: send it embedding or scoring requests (LLM.embed, "
                                      f"LLM.score), not sampling parameters")
        if images:
            raise InvalidRequestError(f"{self.serves()}: it takes text only, not images", field="images")
        self._check_length(len(prompt_token_ids))
        if token_type_ids is not None and len(token_type_ids) != len(prompt_token_ids):
            raise InvalidRequestError(f"{len(token_type_ids)} token type ids for {len(prompt_token_ids)} tokens")
        if not 0 <= skip < max(len(prompt_token_ids), 1):
            raise InvalidRequestError(f"skip {skip} leaves no token of the {len(prompt_token_ids)} to pool")
        self.pooler.check(params)
        if self.bidirectional or self.pooler.rows != "last":  # no cached prefix may stand in for its rows
            cache_salt = f"{cache_salt or ''}\x1fpooled:{next(self._salts)}"
        state = super().add_request(request_id, prompt_token_ids, SamplingParams(max_tokens=1), priority=priority,
                                    cache_salt=cache_salt, lora=lora)
        self._pooled[state.seqs[0].seq_id] = PooledRequest(params, token_type_ids, skip)
        return state

    def _check_length(self, length: int) -> None:
        if length > self.max_input_len:
            raise InvalidRequestError(f"input has {length} tokens, more than this model takes (max_model_len "
                                      f"{self.max_input_len}); shorten it or ask for truncation "
                                      f"(truncate_prompt_tokens)")
        budget = self.scheduler.max_step_tokens
        if self.bidirectional and budget is not None and length > budget:
            raise InvalidRequestError(f"input has {length} tokens, but this encoder attends both ways, so a prompt "
                                      f"runs in one step of at most {budget} tokens (the scheduler's "
                                      f"max_num_batched_tokens); raise it or shorten the input")

    # ------------------------------------------------------------------ one step

    def _schedule(self) -> SchedulerOutput:
        out = super()._schedule()
        if self.bidirectional:  # a chunk of an encoder's prompt waits for a step with room for all of it
            out.scheduled = [i for i in out.scheduled
                             if i.seq.num_computed_tokens + i.num_query_tokens == i.seq.num_tokens]
        return out

    def _forward_and_decode(self, batch: BatchMetadata, parts: list[BatchMetadata] | None = None
                            ) -> tuple[torch.Tensor, list[list[int]]]:
        """The final hidden states of the rows the pooler reads (``_rows``' order); nothing decoded."""
        rows = [row for _, row, _ in self._rows(batch)]
        view = dataclasses.replace(batch, logits_indices=torch.tensor(rows, dtype=torch.long, device=batch.input_ids.device))
        hidden = self._forward(view, hidden_states=True, token_type_ids=self._token_types(batch))
        return hidden, []

    def _rows(self, batch: BatchMetadata) -> list[tuple[int, int, int]]:
        """(sequence index in the batch, packed row, position) of each row the pooler reads
        this step: a sequence's first pooled position, its last, or every one past ``skip``."""
        wanted, starts = self.pooler.rows, batch.query_starts_cpu
        rows = []
        for i, seq in enumerate(batch.seqs):
            end = batch.seq_lens_cpu[i]
            first = end - batch.query_lens_cpu[i]  # the chunk's first position
            skip = self._pooled[seq.seq_id].skip
            if wanted == "all":
                positions = range(max(first, skip), end)
            elif wanted == "first":
                positions = range(skip, skip + 1) if first <= skip < end else range(0)
            else:
                positions = range(end - 1, end) if end == seq.num_prompt_tokens else range(0)
            rows += [(i, starts[i] + p - first, p) for p in positions]
        return rows

    def _token_types(self, batch: BatchMetadata) -> torch.Tensor | None:
        """Each packed token's type id [T] where a request gave them (else None: all 0)."""
        given = [self._pooled[seq.seq_id].token_type_ids for seq in batch.seqs]
        if all(t is None for t in given):
            return None
        types: list[int] = []
        for i, ids in enumerate(given):
            end = batch.seq_lens_cpu[i]
            first = end - batch.query_lens_cpu[i]
            types += ids[first:end] if ids is not None else [0] * (end - first)
        return torch.tensor(types, dtype=torch.long, device=batch.input_ids.device)

    def _append_tokens(self, step: LaunchedStep) -> None:
        """Keep each sequence's pooled rows (the step's ``logits`` are their hidden states);
        pool the sequences whose prompt this step ended."""
        batch, logits = step.batch, step.logits
        for k, (i, _, position) in enumerate(self._rows(batch)):
            request = self._pooled[batch.seqs[i].seq_id]
            if position == request.skip and request.rows:  # recomputed from the start (after a preemption)
                request.rows.clear()
            request.rows.append((position, logits[k]))
        done = [seq for i, seq in enumerate(batch.seqs) if batch.seq_lens_cpu[i] == seq.num_prompt_tokens]
        if not done:
            return
        requests = [self._pooled[seq.seq_id] for seq in done]
        outputs = self.pooler.pool([torch.stack([row for _, row in r.rows]) for r in requests],
                                   [r.params for r in requests])
        now = time.perf_counter()
        for seq, output in zip(done, outputs):
            self.requests[seq.request_id].pooled = output
            seq.first_token_time = now
            self._finish(seq, FinishReason.STOP)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        super()._finish(seq, reason)
        self._pooled.pop(seq.seq_id, None)
