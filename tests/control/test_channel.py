"""The control channel over real ZeroMQ sockets on loopback."""

from __future__ import annotations

import array
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgpack
import pytest
import zmq

from dualpath.control.channel import (
    ControlClient,
    ControlServer,
    Rejected,
    is_loopback_endpoint,
    new_cluster_token,
)
from dualpath.control.codec import decode, encode, message
from dualpath.errors import PeerUnavailable, TransferTimeout

# For what must arrive over loopback (a message, a handshake, a rejection): waits end as soon as
# it has, so this only bounds a real hang, however loaded the machine.
BUDGET_S = 30.0


@message("test-ping")
@dataclass(frozen=True, slots=True)
class Ping:
    seq: int
    payload: bytes
    engine_ids: tuple[int, ...]


@message("test-batch")
@dataclass(frozen=True, slots=True)
class Batch:
    pings: tuple[Ping, ...]
    note: str | None = None


def test_codec_round_trips_nested_messages() -> None:
    msg = Batch((Ping(1, b"\x00\xff", (3, 4)), Ping(2, b"", ())), note="x")
    assert decode(encode(msg)) == msg


@message("test-tokens")
@dataclass(frozen=True, slots=True)
class Tokens:
    token_ids: array.array
    nested: tuple[array.array, ...] = ()


def test_codec_packs_uint32_arrays_and_returns_sequences_as_tuples() -> None:
    ids = array.array("I", [0, 7, 65_536, 2**32 - 1])
    data = encode(Tokens(ids, (array.array("I"),)))
    # The four ids go as 16 contiguous little-endian bytes, not as msgpack ints.
    assert b"\x00\x00\x00\x00\x07\x00\x00\x00\x00\x00\x01\x00\xff\xff\xff\xff" in data
    decoded = decode(data)
    assert decoded == Tokens(ids, (array.array("I"),))
    assert type(decoded.token_ids) is array.array and decoded.token_ids.typecode == "I"
    assert type(decode(encode(Ping(1, b"", [3, 4]))).engine_ids) is tuple  # a list goes out


def test_codec_refuses_other_arrays_and_torn_packed_ids() -> None:
    with pytest.raises(TypeError, match="array\\('I'\\)"):
        encode(Tokens(array.array("q", [1])))
    torn = msgpack.packb(("test-tokens", msgpack.ExtType(2, bytes(7)), ()))
    with pytest.raises(ValueError, match="packed uint32 array of 7 bytes"):
        decode(torn)


@pytest.mark.parametrize(
    "data",
    [b"", b"\xc1", encode(Ping(1, b"", ()))[:-1], b"\x92\xa9test-ping\x01", b"\x91\xa4nope"],
)
def test_codec_rejects_malformed_bytes(data: bytes) -> None:
    with pytest.raises(ValueError):
        decode(data)


def test_codec_refuses_unregistered_types() -> None:
    with pytest.raises(TypeError):
        encode(object())


@pytest.fixture
def server():
    token = new_cluster_token()
    srv = ControlServer("tcp://127.0.0.1:0", token)
    yield srv, token
    srv.close()


def _serve_until(
    srv: ControlServer, is_done: Callable[[list[tuple[str, object]]], bool]
) -> list[tuple[str, object]]:
    """Poll the server until ``is_done(what it returned so far)``; that list."""
    got: list[tuple[str, object]] = []
    deadline_s = time.monotonic() + BUDGET_S
    while not is_done(got):
        assert time.monotonic() < deadline_s, f"the server saw only {got}"
        got += srv.poll(0.05)
    return got


def test_welcomed_client_exchanges_messages(server) -> None:
    srv, token = server
    client = ControlClient(srv.endpoint, "engine-0", token)
    _handshake(srv, client)
    client.send(Ping(7, b"abc", (1, 2)))
    got = _serve_until(srv, lambda got: len(got) >= 1)
    assert got == [("engine-0", Ping(7, b"abc", (1, 2)))]
    srv.send("engine-0", Batch((Ping(8, b"", ()),)))
    assert client.poll(BUDGET_S) == [Batch((Ping(8, b"", ()),))]
    client.close()


def test_a_client_that_reads_late_loses_no_message(server) -> None:
    # ZeroMQ's default high-water marks (1,000 messages per queue) make a ROUTER drop, silently,
    # what it cannot queue for a slow reader: an Assignment lost that way leaves a request
    # stuck. Both ends run without a limit, so a late reader gets every message.
    srv, token = server
    client = ControlClient(srv.endpoint, "engine-0", token)
    _handshake(srv, client)
    num_messages = 5000
    for i in range(num_messages):
        srv.send("engine-0", Ping(i, b"x" * 4096, ()))
    received: list[object] = []
    deadline_s = time.monotonic() + BUDGET_S  # one poll may return a few messages
    while len(received) < num_messages and time.monotonic() < deadline_s:
        received += client.poll(0.05)
    assert [m.seq for m in received] == list(range(num_messages))
    client.close()


def _handshake(srv: ControlServer, client: ControlClient) -> None:
    import threading

    stop = threading.Event()

    def pump() -> None:
        while not stop.is_set():
            srv.poll(0.02)

    thread = threading.Thread(target=pump)
    thread.start()
    try:
        client.connect(timeout_s=BUDGET_S)
    finally:
        stop.set()
        thread.join()


def test_one_encoding_goes_to_several_clients_and_a_restarted_client_is_sent_to(
    server,
) -> None:
    srv, token = server
    first = ControlClient(srv.endpoint, "engine-0", token)
    other = ControlClient(srv.endpoint, "engine-1", token)
    _handshake(srv, first)
    _handshake(srv, other)
    data = encode(Ping(9, b"x", (1,)))
    srv.send_encoded("engine-0", data)
    srv.send_encoded("engine-1", data)
    assert first.poll(BUDGET_S) == [Ping(9, b"x", (1,))]
    assert other.poll(BUDGET_S) == [Ping(9, b"x", (1,))]
    # The same client id says hello again from a new socket: sends go there now.
    restarted = ControlClient(srv.endpoint, "engine-0", token)
    _handshake(srv, restarted)
    srv.send("engine-0", Ping(10, b"", ()))
    assert restarted.poll(BUDGET_S) == [Ping(10, b"", ())]
    assert first.poll(0.2) == []  # a late arrival would pass unseen, never fail the test
    assert sorted(srv.client_ids) == ["engine-0", "engine-1"]
    srv.forget("engine-0")
    with pytest.raises(PeerUnavailable):
        srv.send_encoded("engine-0", data)
    for client in (first, other, restarted):
        client.close()


def test_a_send_only_socket_speaks_for_its_client_id_and_is_never_sent_to(server) -> None:
    """An engine's heartbeat thread has a socket of its own (a ZeroMQ socket is one thread's):
    what it sends is the engine's, and the scheduler's messages still go to the loop's."""
    srv, token = server
    loop = ControlClient(srv.endpoint, "engine-0", token)
    _handshake(srv, loop)
    heartbeat = ControlClient(srv.endpoint, "engine-0", token, is_send_only=True)
    _handshake(srv, heartbeat)
    heartbeat.send(Ping(1, b"", ()))
    assert _serve_until(srv, lambda got: len(got) >= 1) == [("engine-0", Ping(1, b"", ()))]
    srv.send("engine-0", Ping(2, b"", ()))
    assert loop.poll(BUDGET_S) == [Ping(2, b"", ())]
    assert heartbeat.poll(0.2) == []  # a late arrival would pass unseen, never fail the test
    assert srv.client_ids == ["engine-0"]
    # Forgotten (declared dead): neither socket is heard any more.
    srv.forget("engine-0")
    heartbeat.send(Ping(3, b"", ()))
    assert _serve_until(srv, lambda _: srv.num_rejected == 1) == []
    assert isinstance(heartbeat.poll(BUDGET_S)[0], Rejected)
    loop.close()
    heartbeat.close()


def test_wrong_token_is_rejected_and_not_heard(server) -> None:
    srv, _ = server
    client = ControlClient(srv.endpoint, "intruder", "not-the-token")
    with pytest.raises(PeerUnavailable, match="wrong cluster token"):
        _handshake(srv, client)
    client.send(Ping(1, b"", ()))
    # Served until the ping was handled (rejected: the hello was the first): nothing surfaced.
    assert _serve_until(srv, lambda _: srv.num_rejected == 2) == []
    assert isinstance(client.poll(BUDGET_S)[0], Rejected)
    assert srv.client_ids == []
    with pytest.raises(PeerUnavailable):
        srv.send("intruder", Ping(1, b"", ()))
    client.close()


def test_messages_before_hello_are_refused(server) -> None:
    srv, token = server
    client = ControlClient(srv.endpoint, "engine-1", token)
    client.send(Ping(0, b"", ()))
    assert _serve_until(srv, lambda _: srv.num_rejected == 1) == []
    assert isinstance(client.poll(BUDGET_S)[0], Rejected)
    assert srv.num_rejected == 1
    client.close()


def test_garbage_frames_are_counted_and_dropped(server) -> None:
    srv, token = server
    raw = zmq.Context.instance().socket(zmq.DEALER)
    raw.connect(srv.endpoint)
    raw.send(b"\xc1garbage")
    raw.send_multipart([b"a", b"b"])
    assert _serve_until(srv, lambda _: srv.num_malformed == 2) == []
    raw.close(linger=0)


def test_client_times_out_without_a_server() -> None:
    client = ControlClient("tcp://127.0.0.1:1", "engine-0", "t")
    with pytest.raises(TransferTimeout):
        client.connect(timeout_s=0.2)
    client.close()


def test_server_requires_a_token_and_flags_public_binds() -> None:
    with pytest.raises(ValueError, match="token"):
        ControlServer("tcp://127.0.0.1:0", "")
    assert is_loopback_endpoint("tcp://127.0.0.1:5555")
    assert is_loopback_endpoint("tcp://localhost:5555")
    assert not is_loopback_endpoint("tcp://0.0.0.0:5555")
    assert not is_loopback_endpoint("tcp://10.1.2.3:5555")


def test_poll_returns_after_max_messages_while_more_keep_coming(server) -> None:
    srv, token = server
    client = ControlClient(srv.endpoint, "engine-2", token)
    _handshake(srv, client)
    for seq in range(30):
        client.send(Ping(seq, b"", ()))
    got = []
    deadline_s = time.monotonic() + BUDGET_S
    while len(got) < 30 and time.monotonic() < deadline_s:
        batch = srv.poll(0.05, max_messages=10)
        assert len(batch) <= 10
        got += batch
    assert [msg.seq for _, msg in got] == list(range(30))
    client.close()


def test_wake_ends_a_poll_early_and_messages_still_arrive(server) -> None:
    import threading

    srv, token = server
    client = ControlClient(srv.endpoint, "engine-0", token)
    _handshake(srv, client)
    timer = threading.Timer(0.05, client.wake)
    timer.start()
    start_s = time.monotonic()
    assert client.poll(60.0) == []  # woken, nothing arrived
    # Woken, not timed out: the only other way out is the whole 60 s.
    assert time.monotonic() - start_s < BUDGET_S
    for _ in range(100):
        client.wake()  # wakes coalesce: the pipe never blocks the waker
    srv.send("engine-0", Ping(1, b"", ()))
    got = []
    deadline_s = time.monotonic() + BUDGET_S
    while not got and time.monotonic() < deadline_s:
        got += client.poll(BUDGET_S)  # the pending wake may end the first poll empty
    assert got == [Ping(1, b"", ())]
    assert client.poll(0.0) == []  # the earlier wakes were drained with it
    client.close()
    client.wake()  # after close: a no-op, not an error
