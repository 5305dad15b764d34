"""A small fake of the OpenAI-compatible completions API, for the benchmark client's tests."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class FakeServer:
    url: str
    # (time.monotonic() at arrival, prompt length) of every request, in arrival order.
    requests: list[tuple[float, int]] = field(default_factory=list)


@contextmanager
def fake_completions_server(max_prompt_tokens: int) -> Iterator[FakeServer]:
    """``POST /v1/completions`` streaming ``max_tokens`` ids (each 7), or a 400 for a prompt
    over ``max_prompt_tokens``, as our server answers one over its limit."""
    requests: list[tuple[float, int]] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 (http.server's name)
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            requests.append((time.monotonic(), len(body["prompt"])))
            if len(body["prompt"]) > max_prompt_tokens:
                self._send(400, json.dumps({"error": {"message": "prompt too long"}}))
                return
            chunks = [{"choices": [{"token_ids": [7]}]} for _ in range(body["max_tokens"])]
            chunks.append({"choices": [], "usage": {"prompt_tokens_details": {}}})
            events = "".join(f"data: {json.dumps(c)}\n\n" for c in chunks) + "data: [DONE]\n\n"
            self._send(200, events)

        def _send(self, status: int, text: str) -> None:
            data = text.encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield FakeServer(f"http://127.0.0.1:{server.server_address[1]}", requests)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
