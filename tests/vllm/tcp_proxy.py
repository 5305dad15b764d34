"""A TCP proxy for tests: what a load balancer or a flaky network does to one connection.

    with TcpProxy(target_port) as proxy:     # listens on proxy.port, forwards to the target
        ... clients connect to proxy.url ...
        proxy.cut()                          # every open connection reset (RST), both sides

New connections keep being accepted and forwarded after a cut: the server behind it lives.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading

_CHUNK_BYTES = 1 << 16


class TcpProxy:
    def __init__(self, target_port: int) -> None:
        self.target = ("127.0.0.1", target_port)
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self.num_cut = 0  # connections cut so far
        self._thread = threading.Thread(target=self._accept, name="tcp-proxy", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> TcpProxy:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._listener.close()
        self.cut()

    def cut(self) -> int:
        """Reset every open connection (both its sides); how many there were."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                with contextlib.suppress(OSError):
                    # RST, not FIN, once closed: a failed connection. The shutdown wakes the
                    # pump blocked in recv() on it (a close() alone would not, and the
                    # connection would stay open, silent, for as long as that recv waits).
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    sock.shutdown(socket.SHUT_RDWR)
                with contextlib.suppress(OSError):
                    sock.close()
        self.num_cut += len(pairs)
        return len(pairs)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:  # closed
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()  # the server is down: so is the connection
                continue
            pair = (client, upstream)
            with self._lock:
                self._pairs.append(pair)
            ends = [threading.Thread(target=_pump, args=p, daemon=True) for p in (pair, pair[::-1])]
            for end in ends:
                end.start()
            threading.Thread(target=self._close_after, args=(pair, ends), daemon=True).start()

    def _close_after(self, pair: tuple[socket.socket, socket.socket], ends: list) -> None:
        """Close a connection both of whose directions ended (a cut closed it already)."""
        for end in ends:
            end.join()
        with self._lock:
            if pair not in self._pairs:
                return
            self._pairs.remove(pair)
        for sock in pair:
            sock.close()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(_CHUNK_BYTES):
            sink.sendall(data)
        sink.shutdown(socket.SHUT_WR)  # a clean end passes through as one
    except OSError:
        pass  # cut, or the other side went away
