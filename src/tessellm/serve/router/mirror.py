"""The live A/B (``tessellm ab --serve A.yaml B.yaml``): every generating request is sent to
both replicas at once, replica 0 (arm A) and replica 1 (arm B). The client gets A's answer,
passed through as the router passes any answer; B's is read in the background and never
holds A's back. Per request and arm the mirror records the wall time, the time to the first
token (streamed requests), the completion tokens and the text of each choice; GET /ab and the
command's exit print the comparison in ``tessellm ab``'s terms: each arm's speed and
latency, the throughput ratio B/A with a paired bootstrap interval over requests, and the
exact-match rate of the texts.

A streamed request is sent to both arms with ``stream_options.include_usage`` on, so both
count their tokens; A's usage chunk is held back from a client that did not ask for it.
Agreement is only meaningful for requests whose outputs do not depend on chance (greedy,
``temperature`` 0, or seeded): only those are compared; every request counts for speed.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import httpx
from fastapi.responses import Response

from tessellm.core.interfaces.routing import RouteRequest
from tessellm.serve.router.proxy import Attempt, Relay, answer_headers, no_replica, relay, send_to
from tessellm.serve.router.replicas import Replica, ReplicaPool

MAX_RECORDS = 100_000
"""Requests kept for the report (the oldest dropped beyond it)."""


@dataclass
class ArmResult:
    """One arm's answer to one mirrored request."""

    start: float
    status: int = 0
    wall_s: float | None = None
    ttft_s: float | None = None
    completion_tokens: int | None = None
    texts: dict[int, str] = field(default_factory=dict)
    error: str | None = None

    def event(self, event: bytes) -> None:
        """Read one server-sent event of a streamed answer."""
        line = event.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            return
        try:
            payload = json.loads(line[6:])
        except ValueError:
            return
        if "error" in payload:
            self.error = str(payload["error"].get("message"))
        for choice in payload.get("choices") or []:
            piece = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if piece:
                if self.ttft_s is None:
                    self.ttft_s = time.perf_counter() - self.start
                self.texts[choice.get("index", 0)] = self.texts.get(choice.get("index", 0), "") + piece
        self._usage(payload)

    def body(self, status: int, content: bytes) -> None:
        """Read a whole (not streamed) answer."""
        self.status = status
        try:
            payload = json.loads(content)
        except ValueError:
            payload = {}
        if status != 200:
            self.error = str((payload.get("error") or {}).get("message", f"HTTP {status}"))
        for choice in payload.get("choices") or []:
            text = choice.get("text") if "text" in choice else (choice.get("message") or {}).get("content")
            self.texts[choice.get("index", 0)] = text or ""
        self._usage(payload)

    def _usage(self, payload: dict[str, Any]) -> None:
        usage = payload.get("usage")
        if isinstance(usage, dict) and usage.get("completion_tokens") is not None:
            self.completion_tokens = int(usage["completion_tokens"])

    def end(self) -> None:
        self.wall_s = time.perf_counter() - self.start

    @property
    def ok(self) -> bool:
        return self.error is None and self.status == 200

    @property
    def tokens_per_s(self) -> float | None:
        if not self.ok or not self.completion_tokens or not self.wall_s:
            return None
        return self.completion_tokens / self.wall_s


@dataclass
class MirroredRequest:
    """Both arms' answers to one request; ``comparable``: greedy or seeded."""

    path: str
    stream: bool
    comparable: bool
    a: ArmResult
    b: ArmResult


def is_deterministic(data: Any) -> bool:
    """Whether a request's outputs do not depend on chance: ``temperature`` 0 (the server's
    default is 1), or a ``seed``."""
    if not isinstance(data, dict):
        return False
    return data.get("temperature", 1.0) == 0 or data.get("seed") is not None


def with_usage(data: Any, body: bytes) -> tuple[bytes, bool]:
    """The body to send both arms (a streamed request asks for usage) and whether the client
    asked for usage itself."""
    if not isinstance(data, dict) or not data.get("stream"):
        return body, True
    options = data.get("stream_options") or {}
    if options.get("include_usage"):
        return body, True
    return json.dumps({**data, "stream_options": {**options, "include_usage": True}}).encode(), False


def usage_only(event: bytes) -> bool:
    """Whether ``event`` is the usage chunk (no choices) a streamed answer ends with."""
    line = event.strip()
    if not line.startswith(b"data: {"):
        return False
    try:
        payload = json.loads(line[6:])
    except ValueError:
        return False
    return not payload.get("choices") and payload.get("usage") is not None


async def send_arm(pool: ReplicaPool, replica: Replica, route: RouteRequest, path: str, body: bytes,
                   headers: dict[str, str], result: ArmResult, arm: str) -> tuple[Attempt, bytes | None, Any] | None:
    """``send_to`` one arm's replica; None, with the failure recorded in ``result``, when it
    cannot be reached."""
    try:
        attempt, first, rest = await send_to(pool, replica, route, "POST", path, body, headers)
    except httpx.TransportError as exc:
        pool.mark_down(replica, f"{type(exc).__name__}: {exc or 'no detail'}")
        result.error, result.status = f"arm {arm} unreachable: {type(exc).__name__}: {exc}", 502
        result.end()
        return None
    result.status = attempt.resp.status_code
    return attempt, first, rest


class Mirror:
    """Mirrors requests to replicas 0 (A) and 1 (B) and keeps what each answered."""

    def __init__(self, labels: tuple[str, str] = ("A", "B"), command: str = ""):
        self.labels, self.command = labels, command
        self.records: list[MirroredRequest] = []
        self.pending: set[asyncio.Task] = set()
        self.started = datetime.now(timezone.utc).isoformat(timespec="seconds")

    async def forward(self, pool: ReplicaPool, route: RouteRequest, path: str, body: bytes, data: Any,
                      headers: dict[str, str]) -> Response:
        """A's answer to the client; B's read in the background; both recorded."""
        send_body, client_wants_usage = with_usage(data, body)
        replica_a, replica_b = pool.replicas[0], pool.replicas[1]
        start = time.perf_counter()
        a, b = ArmResult(start), ArmResult(start)
        arm_b = asyncio.ensure_future(self.read_b(pool, replica_b, route, path, send_body, headers, b))
        done = lambda: self.keep(path, route.stream, is_deterministic(data), a, b, arm_b)  # noqa: E731
        sent = await send_arm(pool, replica_a, route, path, send_body, headers, a, "A")
        if sent is None:
            done()
            return no_replica(pool, {replica_a.index: a.error})
        attempt, first, rest = sent
        if first is None:
            a.body(attempt.resp.status_code, rest)
            a.end()
            await attempt.close(failed=False)
            done()
            return Response(rest, status_code=attempt.resp.status_code, headers=answer_headers(attempt.resp, replica_a))

        def tap(event: bytes) -> bool:
            a.event(event)
            return client_wants_usage or not usage_only(event)

        return Relay(self.recorded(relay(attempt, first, rest, tap), a, done), attempt, attempt.resp.status_code,
                     answer_headers(attempt.resp, replica_a))

    @staticmethod
    async def recorded(events: Any, a: ArmResult, done: Any) -> Any:
        """A's events, then its end recorded (however the stream ends)."""
        try:
            async for event in events:
                yield event
        finally:
            await events.aclose()
            a.end()
            done()

    async def read_b(self, pool: ReplicaPool, replica: Replica, route: RouteRequest, path: str, body: bytes,
                     headers: dict[str, str], b: ArmResult) -> None:
        """Arm B's whole answer, read and recorded; a failure is recorded, never raised."""
        sent = await send_arm(pool, replica, route, path, body, headers, b, "B")
        if sent is None:
            return
        attempt, first, rest = sent
        try:
            if first is None:
                b.body(attempt.resp.status_code, rest)
            else:
                async for event in relay(attempt, first, rest, None):
                    b.event(event)
        finally:
            b.end()
            await attempt.close(failed=False)

    def keep(self, path: str, stream: bool, comparable: bool, a: ArmResult, b: ArmResult, arm_b: asyncio.Task) -> None:
        """Record the request once B's answer is in too (A's never waits for it)."""
        async def when_b_ends() -> None:
            await asyncio.gather(arm_b, return_exceptions=True)
            self.records.append(MirroredRequest(path, stream, comparable, a, b))
            del self.records[:-MAX_RECORDS]

        task = asyncio.ensure_future(when_b_ends())
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def drain(self) -> None:
        """Wait for the B answers still being read (at shutdown)."""
        if self.pending:
            await asyncio.gather(*list(self.pending), return_exceptions=True)

    def report(self, urls: tuple[str, str] = ("", "")) -> dict[str, Any]:
        """The comparison so far (``ab_report.live_report``)."""
        from tessellm.serve.router.ab_report import live_report

        return live_report(self.records, self.labels, self.command, self.started, urls)
