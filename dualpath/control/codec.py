"""Messages on the control channel: frozen dataclasses <-> msgpack bytes.

Every message type registers under a short tag; the wire form is ``[tag, field values...]`` in
field order (no field names on the wire: the two ends run the same code, and a hello carries
the protocol version). Nested registered dataclasses, tuples, lists, dicts, bytes, ints,
floats, strings, bools and None round-trip; tuples come back as tuples where the field's
annotation says so.

    @message("fetch")
    @dataclass(frozen=True, slots=True)
    class Fetch: ...

    data = encode(Fetch(...)); msg = decode(data)   # ValueError on anything malformed
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack

PROTOCOL_VERSION = 1

T = TypeVar("T")

_tag_to_type: dict[str, type] = {}
_type_to_tag: dict[type, str] = {}
# Per type: (field names, which fields are tuples), computed once at registration.
_type_to_fields: dict[type, tuple[tuple[str, ...], tuple[bool, ...]]] = {}
_EXT_MESSAGE = 1  # msgpack ext type code for a nested registered dataclass


def message(tag: str) -> Callable[[type[T]], type[T]]:
    """Register a frozen dataclass as a control message under ``tag`` (unique)."""

    def register(cls: type[T]) -> type[T]:
        if not dataclasses.is_dataclass(cls):
            raise RuntimeError(f"caller bug: {cls.__name__} is not a dataclass")
        if tag in _tag_to_type:
            raise RuntimeError(f"caller bug: message tag {tag!r} registered twice")
        fields = dataclasses.fields(cls)
        _tag_to_type[tag] = cls
        _type_to_tag[cls] = tag
        _type_to_fields[cls] = (
            tuple(f.name for f in fields),
            tuple(str(f.type).startswith("tuple") for f in fields),
        )
        return cls

    return register


def _default(obj: object) -> object:
    tag = _type_to_tag.get(type(obj))
    if tag is None:
        raise TypeError(f"cannot encode {type(obj).__name__} on the control channel")
    return msgpack.ExtType(_EXT_MESSAGE, _pack(obj, tag))


def _pack(obj: object, tag: str) -> bytes:
    names, _ = _type_to_fields[type(obj)]
    values = [tag, *(getattr(obj, name) for name in names)]
    return msgpack.packb(values, default=_default, use_bin_type=True)


def _ext_hook(code: int, data: bytes) -> object:
    if code != _EXT_MESSAGE:
        raise ValueError(f"unknown msgpack extension type {code}")
    return _unpack(data)


def _unpack(data: bytes) -> Any:
    values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    if not isinstance(values, list) or not values or not isinstance(values[0], str):
        raise ValueError("control message must be [tag, fields...]")
    tag, *fields = values
    cls = _tag_to_type.get(tag)
    if cls is None:
        raise ValueError(f"unknown control message type {tag!r}")
    names, is_tuple = _type_to_fields[cls]
    if len(fields) != len(names):
        raise ValueError(f"{tag}: expected {len(names)} fields, got {len(fields)}")
    kwargs = {
        name: tuple(value) if tuple_field and isinstance(value, list) else value
        for name, value, tuple_field in zip(names, fields, is_tuple, strict=True)
    }
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{tag}: invalid fields: {exc}") from exc


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
