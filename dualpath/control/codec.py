"""Messages on the control channel: frozen dataclasses <-> msgpack bytes.

Every message type registers under a short tag; the wire form is ``[tag, field values...]`` in
field order (no field names on the wire: the two ends run the same code, and a hello carries
the protocol version). Nested registered dataclasses, tuples, lists, dicts, bytes, ints,
floats, strings, bools and None round-trip, except that every sequence comes back as a tuple
(messages are frozen). Token ids travel packed: an ``array.array("I")`` goes as one bytes
blob of little-endian uint32 (4 bytes an id, against up to 5 as msgpack ints, and one copy
rather than a Python int per id) and comes back as an ``array.array("I")``.

    @message("fetch")
    @dataclass(frozen=True, slots=True)
    class Fetch: ...

    data = encode(Fetch(...)); msg = decode(data)   # ValueError on anything malformed
"""

from __future__ import annotations

import array
import dataclasses
import sys
from collections.abc import Callable
from operator import attrgetter
from typing import Any, TypeVar

import msgpack

# 2: token ids as packed uint32 arrays; sequences decode as tuples. 3: engine and group
# reports carry write_queue_tokens (the scheduler's write_q). 4: an Assignment carries the
# output a continued request has sent (num_output_tokens), a RequestFailed the peer whose
# transfer failed (peer_engine_id). 5: engines send EngineHeartbeats over a send-only socket
# (Hello.is_send_only); a PE says whether it reports what its engine holds
# (EngineInfo.reports_prefill_held), an Assignment whether the DE waits for it
# (Assignment.is_prefill_held_sent). 6: an Assignment carries the request's cache salt
# (Assignment.cache_salt), and its agent session's retention (session_retention_s). 7: a DE
# says whether it prefills requests placed on it alone (EngineInfo.prefills_locally).
PROTOCOL_VERSION = 7

T = TypeVar("T")

_tag_to_type: dict[str, type] = {}
_type_to_tag: dict[type, str] = {}
# Per type: its field values in field order as a tuple, and how many there are; built once at
# registration (an attrgetter reads them all in one C call).
_type_to_fields: dict[type, tuple[Callable[[Any], tuple], int]] = {}
_EXT_MESSAGE = 1  # msgpack ext type code for a nested registered dataclass
_EXT_UINT32_ARRAY = 2  # msgpack ext type code for an array("I"): little-endian uint32 bytes
_IS_BIG_ENDIAN = sys.byteorder == "big"
assert array.array("I").itemsize == 4, "packed token ids assume a 4-byte C unsigned int"


def message(tag: str) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as a control message under ``tag`` (unique)."""

    def register(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise RuntimeError(f"caller bug: {cls.__name__} is not a dataclass")
        if tag in _tag_to_type:
            raise RuntimeError(f"caller bug: message tag {tag!r} registered twice")
        names = tuple(f.name for f in dataclasses.fields(cls))
        _tag_to_type[tag] = cls
        _type_to_tag[cls] = tag
        _type_to_fields[cls] = (_values_getter(names), len(names))
        return cls

    return register


def _values_getter(names: tuple[str, ...]) -> Callable[[Any], tuple]:
    if len(names) > 1:
        return attrgetter(*names)
    if len(names) == 1:
        name = names[0]
        return lambda obj: (getattr(obj, name),)
    return lambda obj: ()


def _default(obj: object) -> object:
    if type(obj) is array.array:
        return msgpack.ExtType(_EXT_UINT32_ARRAY, _uint32_bytes(obj))
    tag = _type_to_tag.get(type(obj))
    if tag is None:
        raise TypeError(f"cannot encode {type(obj).__name__} on the control channel")
    return msgpack.ExtType(_EXT_MESSAGE, _pack(obj, tag))


def _uint32_bytes(ids: array.array) -> bytes:
    if ids.typecode != "I":
        raise TypeError(f"only array('I') goes on the control channel, got array({ids.typecode!r})")
    if _IS_BIG_ENDIAN:
        ids = array.array("I", ids)
        ids.byteswap()
    return ids.tobytes()


def _pack(obj: object, tag: str) -> bytes:
    values, _ = _type_to_fields[type(obj)]
    return msgpack.packb((tag, *values(obj)), default=_default, use_bin_type=True)


def _ext_hook(code: int, data: bytes) -> object:
    if code == _EXT_UINT32_ARRAY:
        if len(data) % 4:
            raise ValueError(f"packed uint32 array of {len(data)} bytes")
        ids = array.array("I", data)  # bytes initialise an array as frombytes does
        if _IS_BIG_ENDIAN:
            ids.byteswap()
        return ids
    if code != _EXT_MESSAGE:
        raise ValueError(f"unknown msgpack extension type {code}")
    return _unpack(data)


def _unpack(data: bytes) -> Any:
    values = msgpack.unpackb(
        data, ext_hook=_ext_hook, raw=False, strict_map_key=False, use_list=False
    )
    if not isinstance(values, tuple) or not values or not isinstance(values[0], str):
        raise ValueError("control message must be [tag, fields...]")
    cls = _tag_to_type.get(values[0])
    if cls is None:
        raise ValueError(f"unknown control message type {values[0]!r}")
    _, num_fields = _type_to_fields[cls]
    if len(values) != num_fields + 1:
        raise ValueError(f"{values[0]}: expected {num_fields} fields, got {len(values) - 1}")
    try:
        return cls(*values[1:])
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{values[0]}: invalid fields: {exc}") from exc


def check_encodable(value: object, what: str) -> None:
    """``ValueError`` naming ``what`` unless ``value`` can cross the control channel (msgpack
    holds 64-bit integers at most): a value that cannot must be refused where it comes in, not
    by the loop that sends it on."""
    try:
        msgpack.packb(value, default=_default)
    except (TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"{what} cannot be sent to the engines: {exc}") from exc


def encode(msg: object) -> bytes:
    """Bytes of a registered message; ``TypeError`` for an unregistered type (a caller bug)."""
    tag = _type_to_tag.get(type(msg))
    if tag is None:
        raise TypeError(f"{type(msg).__name__} is not a registered control message")
    return _pack(msg, tag)


def decode(data: bytes) -> Any:
    """The message in ``data``; ``ValueError`` for anything malformed or unknown."""
    try:
        return _unpack(data)
    except ValueError:
        raise
    except Exception as exc:  # msgpack raises several unrelated types for garbage
        raise ValueError(f"malformed control message: {exc}") from exc
