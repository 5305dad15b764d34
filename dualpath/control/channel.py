"""ZeroMQ control channel: one server (the scheduler process), many clients (engines).

The server binds a ROUTER socket (loopback unless told otherwise); each client connects a
DEALER with its own identity. A client's first message must be a ``Hello`` carrying the
cluster token; the server answers ``Welcome`` or ``Rejected`` and ignores everything else a
client sends before it is welcomed. Tokens are compared in constant time. Messages are the
registered dataclasses of ``dualpath.control.codec``.

A client id may have a second, send-only socket (``ControlClient(is_send_only=True)``): what it
sends counts as the client's, and the server never sends to it but the handshake's answer. An
engine's heartbeat thread speaks through one (``dualpath.cluster.engine_heartbeat``): a ZeroMQ
socket belongs to one thread, and the engine's loop owns the other.

Every receive takes an explicit ``timeout_s``; nothing here blocks forever.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import logging
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import zmq

from dualpath.control.codec import PROTOCOL_VERSION, decode, encode, message
from dualpath.errors import PeerUnavailable, TransferTimeout

logger = logging.getLogger(__name__)

_ZERO_COPY_MIN_BYTES = 1 << 16  # pyzmq's own threshold: below it, copying is cheaper


@message("hello")
@dataclass(frozen=True, slots=True)
class Hello:
    """A client's first message: who it is and the shared cluster token."""

    client_id: str
    token: str
    protocol_version: int = PROTOCOL_VERSION
    # A second socket of an already welcomed client id, that only sends (a heartbeat thread's):
    # its messages count as the client's; the server keeps sending to the client's own socket.
    is_send_only: bool = False


@message("welcome")
@dataclass(frozen=True, slots=True)
class Welcome:
    client_id: str


@message("rejected")
@dataclass(frozen=True, slots=True)
class Rejected:
    reason: str


def new_cluster_token() -> str:
    """A random token for a cluster whose processes one launcher starts."""
    return secrets.token_hex(16)


def is_loopback_endpoint(endpoint: str) -> bool:
    host = urlsplit(endpoint).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _WakePipe:
    """A pipe a poller waits on beside its socket: ``wake`` (any thread) ends the wait early,
    so that work handed over by another thread is taken up now, not at the wait's timeout."""

    def __init__(self, poller: zmq.Poller) -> None:
        self._poller = poller
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        poller.register(self._read_fd, zmq.POLLIN)

    def wake(self) -> None:
        """Cheap, never blocks; many wakes before a wait count as one."""
        fd = self._write_fd
        if fd < 0:
            return  # closed: shutting down
        with contextlib.suppress(BlockingIOError):  # the pipe is full: a wake is pending
            os.write(fd, b"\0")

    def drain(self, events: dict) -> None:
        """Take the pending wakes, if the wait ``events`` came from says there are some."""
        if self._read_fd in events:
            with contextlib.suppress(BlockingIOError):  # drained
                while os.read(self._read_fd, 4096):
                    pass

    def close(self) -> None:
        write_fd, self._write_fd = self._write_fd, -1
        if write_fd >= 0:
            self._poller.unregister(self._read_fd)
            os.close(self._read_fd)
            os.close(write_fd)


class ControlServer:
    """The scheduler side. ``poll`` returns (client_id, message) pairs from welcomed clients;
    ``wake`` (any thread) ends a wait for them early."""

    def __init__(self, endpoint: str, token: str, *, context: zmq.Context | None = None) -> None:
        if not token:
            raise ValueError("a cluster token is required to open the control port")
        if urlsplit(endpoint).scheme != "tcp" and not endpoint.startswith("ipc://"):
            raise ValueError(
                f"control endpoint must be tcp://HOST:PORT or ipc://PATH, got {endpoint!r}"
            )
        if endpoint.startswith("tcp://") and not is_loopback_endpoint(endpoint):
            logger.warning("control port %s is reachable from other hosts", endpoint)
        self._token = token.encode()
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client reuses its id
        # No high-water mark: at the default (1,000 messages) a ROUTER silently drops what it
        # cannot queue for a slow client, and a lost Assignment is a stuck request. A client
        # that stops reading for good is declared dead by the heartbeat instead.
        self._socket.setsockopt(zmq.SNDHWM, 0)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        if endpoint.endswith(":0"):
            port = self._socket.bind_to_random_port(endpoint.rsplit(":", 1)[0])
            self.endpoint = f"{endpoint.rsplit(':', 1)[0]}:{port}"
        else:
            self._socket.bind(endpoint)
            self.endpoint = endpoint
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        self._wake = _WakePipe(self._poller)
        self._welcomed: dict[bytes, str] = {}  # socket identity -> client id
        # Where to send to each client: a dict, not a scan of ``_welcomed`` per message.
        self._client_id_to_identity: dict[str, bytes] = {}
        self.num_rejected = 0
        self.num_malformed = 0

    @property
    def client_ids(self) -> list[str]:
        return list(self._client_id_to_identity)

    def wake(self) -> None:
        """End the current or next wait for messages early, from any thread."""
        self._wake.wake()

    def poll(self, timeout_s: float, max_messages: int = 1024) -> list[tuple[str, object]]:
        """Messages that arrived within ``timeout_s``: what is queued, up to ``max_messages``,
        so a caller's loop gets control back even while messages keep arriving."""
        return list(self.receive(timeout_s, max_messages))

    def receive(self, timeout_s: float, max_messages: int = 1024) -> Iterator[tuple[str, object]]:
        """``poll``, one message at a time: each is decoded when the caller asks for it.

        A loop that handles each message before taking the next keeps a turn's messages from
        all being alive at once. Held in a list, a backlog of a thousand decoded reports sets
        off the garbage collector, older generations included: 144 clients sending to a
        process holding 150K objects took 17 us a message that way, 10 us one at a time.
        """
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        if not events:
            return
        self._wake.drain(events)
        # Frame by frame, not recv_multipart: that asks the socket after every frame whether
        # more follow, about 2 us a time, and reports arrive at 14,400/s at 48P96D. The ROUTER
        # puts the sender's identity in front of what it sent, so a message of ours is two
        # frames and only the second needs asking.
        recv = self._socket.recv
        for _ in range(max_messages):
            try:
                identity = recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            frame = recv(zmq.NOBLOCK, copy=False)  # the rest of a message is already here
            if frame.more:  # more than one frame: not one of ours
                self.num_malformed += 1
                while recv(zmq.NOBLOCK, copy=False).more:
                    pass
                continue
            item = self._accept(identity, frame.bytes)
            if item is not None:
                yield item

    def _accept(self, identity: bytes, data: bytes) -> tuple[str, object] | None:
        try:
            msg = decode(data)
        except ValueError as exc:
            self.num_malformed += 1
            logger.warning("dropping malformed control message: %s", exc)
            return None
        if isinstance(msg, Hello):
            self._handshake(identity, msg)
            return None
        client_id = self._welcomed.get(identity)
        if client_id is None:
            self.num_rejected += 1
            self._send_raw(identity, Rejected("say hello with the cluster token first"))
            return None
        return client_id, msg

    def _handshake(self, identity: bytes, hello: Hello) -> None:
        if not hmac.compare_digest(hello.token.encode(), self._token):
            self.num_rejected += 1
            logger.warning("rejected %s: wrong cluster token", hello.client_id)
            self._send_raw(identity, Rejected("wrong cluster token"))
            return
        if hello.protocol_version != PROTOCOL_VERSION:
            self.num_rejected += 1
            self._send_raw(
                identity,
                Rejected(f"protocol {hello.protocol_version}, server speaks {PROTOCOL_VERSION}"),
            )
            return
        self._welcomed[identity] = hello.client_id
        # A client id that says hello again from a new socket (a restarted engine) is sent to
        # there from now on; the old socket is still heard until the id is forgotten. A
        # send-only socket is heard, never sent to.
        if not hello.is_send_only:
            self._client_id_to_identity[hello.client_id] = identity
        self._send_raw(identity, Welcome(hello.client_id))

    def send(self, client_id: str, msg: object) -> None:
        """Send to a welcomed client; ``PeerUnavailable`` if it never said hello."""
        self.send_encoded(client_id, encode(msg))

    def send_encoded(self, client_id: str, data: bytes) -> None:
        """Send a message already encoded (``codec.encode``): one message to several clients
        is encoded once. ``PeerUnavailable`` if the client never said hello."""
        identity = self._client_id_to_identity.get(client_id)
        if identity is None:
            raise PeerUnavailable(f"control client {client_id!r} is not connected")
        self._send_frames(identity, data)

    def forget(self, client_id: str) -> None:
        """Drop a client (declared dead); it must say hello again to be heard."""
        self._client_id_to_identity.pop(client_id, None)
        self._welcomed = {i: c for i, c in self._welcomed.items() if c != client_id}

    def _send_raw(self, identity: bytes, msg: object) -> None:
        self._send_frames(identity, encode(msg))

    def _send_frames(self, identity: bytes, data: bytes) -> None:
        # Two sends, not send_multipart (which checks every part in Python first). Past
        # 64 KiB, ZeroMQ takes the bytes without a copy (an Assignment of a long prompt).
        self._socket.send(identity, zmq.SNDMORE)
        self._socket.send(data, copy=len(data) < _ZERO_COPY_MIN_BYTES)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._wake.close()


class ControlClient:
    """An engine's side: ``connect`` says hello; then ``send`` / ``poll``.

    Like its ZeroMQ socket, a client is not thread-safe: one thread uses it (``wake`` aside).
    ``is_send_only``: a second socket of the client id, for another thread's messages (see
    ``Hello.is_send_only``); nothing is sent to it but the answer to its hello.
    """

    def __init__(
        self,
        endpoint: str,
        client_id: str,
        token: str,
        *,
        context: zmq.Context | None = None,
        is_send_only: bool = False,
    ) -> None:
        self.client_id = client_id
        self._token = token
        self.is_send_only = is_send_only
        self._context = context or zmq.Context.instance()
        self._socket = self._context.socket(zmq.DEALER)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.SNDHWM, 0)  # never drop or block a message (see above)
        self._socket.setsockopt(zmq.RCVHWM, 0)
        self._socket.setsockopt(zmq.IDENTITY, f"{client_id}:{secrets.token_hex(4)}".encode())
        self._socket.connect(endpoint)
        self._poller = zmq.Poller()
        self._poller.register(self._socket, zmq.POLLIN)
        # ``wake`` ends a ``poll`` early: work that finished on another thread (a storage
        # read) is taken up now, not at the poll's timeout.
        self._wake = _WakePipe(self._poller)
        self.endpoint = endpoint

    def wake(self) -> None:
        """End the current or next ``poll`` early, from any thread (it then returns what has
        arrived, possibly nothing)."""
        self._wake.wake()

    def connect(self, timeout_s: float) -> None:
        """Say hello; ``PeerUnavailable`` if rejected, ``TransferTimeout`` if no answer."""
        self.say_hello()
        replies = self.poll(timeout_s)
        if not replies:
            raise TransferTimeout(
                f"no answer from the scheduler at {self.endpoint} within {timeout_s} s"
            )
        reply = replies[0]
        if isinstance(reply, Rejected):
            raise PeerUnavailable(f"scheduler at {self.endpoint} rejected us: {reply.reason}")
        if not isinstance(reply, Welcome):
            raise PeerUnavailable(f"unexpected handshake reply {type(reply).__name__}")

    def say_hello(self) -> None:
        """Send the hello and do not wait for its answer (``poll`` returns it)."""
        self.send(Hello(self.client_id, self._token, is_send_only=self.is_send_only))

    def send(self, msg: object) -> None:
        self._socket.send(encode(msg))

    def send_encoded(self, data: bytes) -> None:
        """Send a message already encoded with ``codec.encode`` (to size or reuse it)."""
        self._socket.send(data)

    def poll(self, timeout_s: float) -> list[object]:
        """Messages that arrived within ``timeout_s`` (sooner after a ``wake``); malformed
        ones are logged and dropped."""
        received: list[object] = []
        events = dict(self._poller.poll(max(0, int(timeout_s * 1000))))
        if not events:
            return received
        self._wake.drain(events)
        while True:
            try:
                data = self._socket.recv(zmq.NOBLOCK)
            except zmq.Again:
                return received
            try:
                received.append(decode(data))
            except ValueError as exc:
                logger.warning("dropping malformed control message: %s", exc)

    def close(self) -> None:
        self._socket.close(linger=0)
        self._wake.close()
