"""The ``pool`` request kind: an embedding or a (query, document) score crossing between the
API side and the engine core (serve/engine_protocol.py ``RequestKind``, serve/engine_core.py
``CORE_KINDS``).

Payload (API side to core): ``input`` (one text or one list of token ids) or ``pair``
(``[query, document]``), ``prompt_name``, ``truncate`` (``truncate_prompt_tokens``),
``params`` (``PoolingParams`` fields) and ``lora``. The core turns it into tokens by the
``LLM``'s own rules (``embedding_inputs``, ``score_inputs``: sentence-transformers'
tokenization, its prompts, the pooler's pair layout) under the pipeline's tokenizer lock, and
admits it. Record (core to API side), once, when the request is done: ``[request_id, True,
values, prompt_tokens]``, its embedding or scores as floats. Nothing here imports the HTTP
side's libraries: the core process loads this module too.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

from tessellm.core.errors import InvalidRequestError
from tessellm.core.interfaces.pooling import PoolingParams
from tessellm.serve.engine_protocol import RequestKind, register_kind


@dataclass
class PooledOutput:
    """A pooling request's one output: its embedding or scores, and its prompt's tokens."""

    request_id: str
    finished: bool
    values: list[float]
    prompt_tokens: int


def _pool_payload(*, input: Any = None, pair: tuple[str, str] | None = None, prompt_name: str | None = None,
                  truncate: int | None = None, params: PoolingParams | None = None,
                  lora: str | None = None) -> dict[str, Any]:
    return {"input": input, "pair": None if pair is None else list(pair), "prompt_name": prompt_name,
            "truncate": truncate, "params": (params or PoolingParams()).model_dump(exclude_none=True), "lora": lora}


def _pool_output(records: list[list[Any]]) -> PooledOutput:
    request_id, finished, values, prompt_tokens = records[0]  # one record: a pool request is reported once
    return PooledOutput(request_id, finished, values, prompt_tokens)


POOL = register_kind(RequestKind("pool", _pool_payload, lambda: _pool_output))


class PoolKind:
    """The core's side of ``pool``: tokenize, admit, and report the request once it is done."""

    name = "pool"

    def admit(self, core: Any, request_id: str, payload: dict[str, Any]) -> Future | None:
        self.add(core, request_id, payload)
        return None

    def add(self, core: Any, request_id: str, payload: dict[str, Any]) -> None:
        llm = core.llm
        if llm.pipeline.task == "generate":
            raise InvalidRequestError("this engine generates text (it has no pooler); it admits no embedding or "
                                      "scoring requests", field="model")
        truncate = payload.get("truncate")
        with llm.pipeline.tokenizer_lock:  # shared with the server's threads where the core runs on one
            if payload.get("pair") is not None:
                query, document = payload["pair"]
                item = llm.score_inputs([query], [document], truncate_prompt_tokens=truncate)[0]
            else:
                item = llm.embedding_inputs([payload["input"]], prompt_name=payload.get("prompt_name"),
                                            truncate_prompt_tokens=truncate)[0]
        params = PoolingParams(**payload.get("params") or {})
        core.engine.add_request(request_id, item.token_ids, params, token_type_ids=item.token_type_ids, skip=item.skip,
                                lora=payload.get("lora"))
        core.admitted.append([request_id, len(item.token_ids)])

    def record(self, core: Any, request_id: str, progress: Any) -> list[Any] | None:
        state = core.engine.requests.get(request_id)
        if state is None or not state.finished:
            return None
        core.engine.pop_finished(request_id)
        return [request_id, True, state.pooled.detach().cpu().tolist(), state.seqs[0].num_prompt_tokens]
