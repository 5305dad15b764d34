"""The scheduler's messages and the simulator's records (message.py): frozen dataclasses with a
written-out ``__init__`` (stores through ``object.__setattr__``, which the compiled build makes
direct), built millions of times a simulated hour. From the sources and compiled alike
(`make test-compiled`) they keep a frozen dataclass's equality, hashing, ``repr``, ``fields``,
``replace`` and refusal of writes."""

from __future__ import annotations

import ast
import dataclasses

import pytest

from dualpath import compiled
from dualpath.scheduler import batching, load_planner, message
from dualpath.sim import cluster

VALUES = {
    message.SchedulerRequest: (7, 400, 320, 32, 3),
    message.EngineSnapshot: (3, 2, 900, 11),
    message.NodeSnapshot: (1, 4096, 512),
    message.GroupSnapshot: (
        2,
        (message.EngineSnapshot(0, 1, 10), message.EngineSnapshot(1, 0, 0, 5)),
        (message.NodeSnapshot(0, 64),),
    ),
    message.PrefillAssignment: (7, 2),
    message.DecodeAssignment: (7, 2, 5, load_planner.LoadPlan(3, 1)),
    message.PrefillFetchResult: ((7, 8), (2, 2)),
    message.DecodeFetchResult: ((7,), (2,), (5,), (load_planner.LoadPlan(0, 4),)),
    batching.PrefillWork: (7, 320, 80),
    batching.PrefillChunk: (7, 320, 64, False),
    batching.PrefillBatch: ((batching.PrefillChunk(7, 320, 64, False),), 0.25),
    load_planner.LoadPlan: (3, 1),
    cluster.RequestRecord: (4, 2, 10.0, 10.5, 10.25, 12.0, 64),
}


def _another(value):
    """Another value of the first field's type: an int doubled, a tuple of ints shifted (the
    same length: a fetch result's columns must stay equal), another tuple repeated."""
    if isinstance(value, tuple) and all(isinstance(item, int) for item in value):
        return tuple(item + 1 for item in value)
    return value * 2


def _class_def(cls: type) -> ast.ClassDef:
    # From the source file: in the compiled build the module is an extension.
    tree = ast.parse(compiled.source_path(cls.__module__).read_text(encoding="utf-8"))
    return next(
        node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == cls.__name__
    )


@pytest.mark.parametrize("cls", VALUES, ids=lambda cls: cls.__name__)
def test_a_value_is_built_from_its_fields_in_order_and_compares_by_value(cls):
    args = VALUES[cls]
    value = cls(*args)
    names = [field.name for field in dataclasses.fields(cls)]
    assert tuple(getattr(value, name) for name in names) == args
    assert cls(**dict(zip(names, args, strict=True))) == value
    assert hash(cls(*args)) == hash(value)
    assert repr(value).startswith(f"{cls.__name__}({names[0]}={args[0]!r}")
    other = _another(args[0])
    changed = dataclasses.replace(value, **{names[0]: other})
    assert getattr(changed, names[0]) == other and changed != value
    assert getattr(value, names[0]) == args[0]


@pytest.mark.parametrize("cls", VALUES, ids=lambda cls: cls.__name__)
def test_init_takes_and_stores_every_field_in_order(cls):
    """A field that ``__init__`` forgot would be unset; one stored another way (``self.x =``)
    would raise FrozenInstanceError from the sources."""
    node = _class_def(cls)
    names = [field.name for field in dataclasses.fields(cls)]
    init = next(
        stmt for stmt in node.body if isinstance(stmt, ast.FunctionDef) and stmt.name == "__init__"
    )
    assert [arg.arg for arg in init.args.args[1:]] == names
    stored = [
        (ast.unparse(call.args[1]), ast.unparse(call.args[2]))
        for call in ast.walk(init)
        if isinstance(call, ast.Call) and ast.unparse(call.func) == "object.__setattr__"
    ]
    assert stored == [(repr(name), name) for name in names]


@pytest.mark.parametrize("cls", VALUES, ids=lambda cls: cls.__name__)
def test_fields_cannot_be_written(cls):
    value = cls(*VALUES[cls])
    name = dataclasses.fields(cls)[0].name
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(value, name, VALUES[cls][0] * 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        delattr(value, name)
    assert getattr(value, name) == VALUES[cls][0]
