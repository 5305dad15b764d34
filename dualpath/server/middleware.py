"""ASGI middleware: request ids, arrival times and HTTP metrics; the request-size limit.

Plain ASGI (not Starlette's ``BaseHTTPMiddleware``), so streamed responses pass through
untouched and a client's disconnect still reaches the route.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from dualpath.server.errors import error_body
from dualpath.server.metrics import ServerMetrics

logger = logging.getLogger("dualpath.server.access")

REQUEST_ID_HEADER = "x-request-id"
_CLIENT_REQUEST_ID = re.compile(r"[A-Za-z0-9._:-]{1,64}")


class RequestContextMiddleware:
    """Gives every request an id (the client's ``X-Request-Id`` if it is sane, else a new
    one), echoes it in the response, stamps the arrival time, logs one line per response and
    counts it by route and status."""

    def __init__(self, app: ASGIApp, metrics: ServerMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        arrival_s = time.monotonic()
        request_id = _request_id(scope)
        state = scope.setdefault("state", {})
        state["request_id"], state["arrival_s"] = request_id, arrival_s

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message.setdefault("headers", [])
                message["headers"] = [
                    *message["headers"],
                    (REQUEST_ID_HEADER.encode(), request_id.encode()),
                ]
                status = message["status"]
                route = scope.get("route")
                route_path = getattr(route, "path", "unmatched")
                self.metrics.http_requests.labels(route_path, str(status)).inc()
                logger.info(
                    "request_id=%s method=%s path=%s status=%d latency_to_headers_s=%.4f",
                    request_id,
                    scope["method"],
                    route_path,
                    status,
                    time.monotonic() - arrival_s,
                )
            await send(message)

        await self.app(scope, receive, send_with_id)


def _request_id(scope: Scope) -> str:
    for name, value in scope.get("headers", ()):
        if name == REQUEST_ID_HEADER.encode():
            text = value.decode("latin-1")
            if _CLIENT_REQUEST_ID.fullmatch(text):
                return text
    return uuid.uuid4().hex


class BodySizeLimitMiddleware:
    """Refuses request bodies over ``max_bytes`` with 413, before any route parses them.

    The body is read here (it is bounded) and replayed to the app; the app's later
    ``receive`` calls (disconnect detection) go to the client as usual.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            await self._refuse(scope, receive, send, declared)
            return
        chunks: list[bytes] = []
        num_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return  # the client left before sending its body
            chunk = message.get("body", b"")
            num_bytes += len(chunk)
            if num_bytes > self.max_bytes:
                await self._refuse(scope, receive, send, num_bytes)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        is_replayed = False

        async def replay() -> Message:
            nonlocal is_replayed
            if not is_replayed:
                is_replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, num_bytes: int) -> None:
        message = (
            f"request body of {num_bytes} bytes or more exceeds the limit of {self.max_bytes} bytes"
        )
        response = JSONResponse(error_body(413, message), status_code=413)
        await response(scope, receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
