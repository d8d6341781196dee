"""Forwarding one request to a replica and its answer back, never losing it silently.

- A replica that cannot be reached, or that fails before any byte of its answer reached the
  client (connection refused or reset, no answer, a stream that ends before its first event),
  is taken out (``ReplicaPool.mark_down``) and the request is tried on another replica, at
  most ``max_retries`` times.
- A streamed answer is passed through event by event (whole server-sent events, so an event
  is never cut in two); if its replica stops mid-stream, the client gets an error event
  naming the replica, then ``[DONE]``.
- When no replica can take the request, the client gets a 502 in OpenAI's error shape,
  naming the replicas tried and their last errors.
- A client that leaves closes the replica's answer, so the replica aborts the request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, AsyncGenerator, AsyncIterator, Callable

import httpx
from fastapi.responses import Response, StreamingResponse

from tessellm.core.interfaces.routing import RouteRequest
from tessellm.serve.errors import error
from tessellm.serve.router.replicas import Replica, ReplicaPool

SSE_DONE = b"data: [DONE]\n\n"
HOP_BY_HOP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te", "trailers",
                        "transfer-encoding", "upgrade", "host", "content-length", "accept-encoding",
                        "content-encoding"})
REPLICA_HEADER = "x-tessellm-replica"
"""The response header naming the replica (its index) that answered."""

Tap = Callable[[bytes], bool]
"""Sees each whole event of a streamed answer; returns False to keep it from the client."""


def request_headers(headers: Any) -> dict[str, str]:
    """The client's headers worth passing to a replica (its API key included)."""
    return {k: v for k, v in headers.items() if k.lower() not in HOP_BY_HOP}


def answer_headers(resp: httpx.Response, replica: Replica) -> dict[str, str]:
    headers = {k: v for k, v in resp.headers.items() if k.lower() not in HOP_BY_HOP}
    headers[REPLICA_HEADER] = str(replica.index)
    return headers


def sse_error(message: str, code: str) -> bytes:
    """The error event a stream ends with (the server's own shape), then ``[DONE]``."""
    payload = {"error": {"message": message, "type": "server_error", "param": None, "code": code}}
    return b"data: " + json.dumps(payload).encode() + b"\n\n" + SSE_DONE


async def whole_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The server-sent events of a byte stream, each whole (ending with a blank line); a
    trailing part without its blank line is given as it is."""
    pending = b""
    async for chunk in chunks:
        pending += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in pending:
            event, pending = pending.split(b"\n\n", 1)
            yield event + b"\n\n"
    if pending.strip():
        yield pending


@dataclass
class Attempt:
    """A request sent to one replica: its answer's response, and whether it ended."""

    pool: ReplicaPool
    route: RouteRequest
    replica: Replica
    resp: httpx.Response | None = None
    ended: bool = field(default=False)

    async def close(self, failed: bool) -> None:
        """End the attempt once: close the replica's answer and tell the pool."""
        if self.ended:
            return
        self.ended = True
        if self.resp is not None:
            await self.resp.aclose()
        self.pool.end(self.route, self.replica, ok=not failed)


class Relay(StreamingResponse):
    """A replica's streamed answer passed to the client; however it ends (the client gone
    before the first byte included), its attempt is closed."""

    def __init__(self, body: AsyncIterator[bytes], attempt: Attempt, status: int, headers: dict[str, str]):
        super().__init__(body, status_code=status, headers=headers, media_type="text/event-stream")
        self.attempt = attempt

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        except OSError:  # a write to a client that left
            pass
        finally:
            await self.body_iterator.aclose()
            await self.attempt.close(failed=False)  # no-op when the body already closed it


async def relay(attempt: Attempt, first: bytes, events: AsyncGenerator[bytes, None],
                tap: Tap | None) -> AsyncIterator[bytes]:
    """The events of a streamed answer (``first`` already read), then the end: the replica's
    own, or an error event when it stops mid-stream."""
    failed = False
    try:
        if tap is None or tap(first):
            yield first
        async for event in events:
            if tap is None or tap(event):
                yield event
    except httpx.TransportError as exc:
        failed = True
        replica = attempt.replica
        reason = f"{type(exc).__name__}: {exc or 'connection lost'}"
        attempt.pool.mark_down(replica, f"stopped mid-stream: {reason}")
        attempt.pool.metrics.failures.labels("replica_lost_mid_answer").inc()
        yield sse_error(f"replica {replica.index} ({replica.url}) stopped answering mid-stream ({reason}); "
                        f"the answer is incomplete", "replica_failed")
    finally:
        await attempt.close(failed)
        await events.aclose()  # the event splitter over the closed answer


async def send_to(pool: ReplicaPool, replica: Replica, route: RouteRequest, method: str, path: str, body: bytes,
                  headers: dict[str, str], params: Any = None) -> tuple[Attempt, bytes | None, Any]:
    """Send the request to ``replica`` and read up to the first event of a streamed answer
    (the whole body of another). Returns (attempt, first event or None, the rest of the
    events or the whole body). A transport error, or a stream that ends with no event,
    closes the attempt as failed and raises ``httpx.TransportError``."""
    attempt = Attempt(pool, route, replica)
    pool.begin(route, replica)
    try:
        request = pool.client.build_request(method, replica.url + path, content=body, headers=headers, params=params)
        attempt.resp = await pool.client.send(request, stream=True)
        if attempt.resp.headers.get("content-type", "").startswith("text/event-stream"):
            events = whole_events(attempt.resp.aiter_raw())
            first = await anext(events, None)
            if first is None:
                raise httpx.RemoteProtocolError("the stream ended before its first event")
            return attempt, first, events
        return attempt, None, await attempt.resp.aread()
    except httpx.TransportError:
        await attempt.close(failed=True)
        raise
    except BaseException:  # the client left (cancelled) or a bug: the replica's answer is closed
        await attempt.close(failed=False)
        raise


async def forward(pool: ReplicaPool, route: RouteRequest, method: str, path: str, body: bytes, headers: dict[str, str],
                  *, max_retries: int, params: Any = None) -> Response:
    """The answer to one request from the replica the policy picks, retried on others (at most
    ``max_retries``) while no byte has reached the client."""
    tried: dict[int, str] = {}
    for attempt_number in range(max_retries + 1):
        replica = pool.choose(route, exclude=set(tried))
        if replica is None:
            break
        if attempt_number:
            pool.metrics.retries.inc()
        try:
            attempt, first, rest = await send_to(pool, replica, route, method, path, body, headers, params)
        except httpx.TransportError as exc:
            tried[replica.index] = f"{type(exc).__name__}: {exc or 'no detail'}"
            pool.mark_down(replica, tried[replica.index])
            continue
        resp = attempt.resp
        if first is not None:
            return Relay(relay(attempt, first, rest, None), attempt, resp.status_code, answer_headers(resp, replica))
        await attempt.close(failed=False)
        return Response(rest, status_code=resp.status_code, headers=answer_headers(resp, replica))
    return no_replica(pool, tried)


def no_replica(pool: ReplicaPool, tried: dict[int, str]) -> Response:
    """The 502 a request gets when no replica could answer it."""
    pool.metrics.failures.labels("no_healthy_replica").inc()
    down = {r.index: r.last_error for r in pool.replicas if not r.healthy and r.index not in tried}
    said = [f"replica {i} ({pool.replicas[i].url}): {why}" for i, why in {**tried, **down}.items()]
    return error(502, "no replica could answer this request: " + ("; ".join(said) or "no replica is healthy"),
                 kind="server_error", code="no_healthy_replica")
