"""The optional compiled build (dualpath/compiled.py): when it is loaded, and that it changes
no result. `make test-compiled` runs these and the simulator's and scheduler's tests with
DUALPATH_COMPILED=1 against a real build; `make test` has none and checks the guard."""

from __future__ import annotations

import importlib.machinery
import json
import logging
import os
import subprocess
import sys

import pytest

from dualpath import compiled


def _fake_build(directory, *, digests=None, python=None):
    directory.mkdir(parents=True, exist_ok=True)
    compiled.write_manifest(directory, digests or compiled.source_digests(), "test")
    if python is not None:
        manifest = json.loads((directory / compiled.MANIFEST_NAME).read_text())
        manifest["python"] = python
        (directory / compiled.MANIFEST_NAME).write_text(json.dumps(manifest))
    return directory


def test_every_compiled_module_has_a_source():
    for module in compiled.COMPILED_MODULES:
        assert compiled.source_path(module).is_file(), module
    assert len(set(compiled.COMPILED_MODULES)) == len(compiled.COMPILED_MODULES)


def test_no_build_is_silently_not_used(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="dualpath.compiled"):
        assert not compiled.decide("", tmp_path / "none")
        assert not compiled.decide("0", tmp_path / "none")
    assert not caplog.records
    with pytest.raises(ImportError, match="no compiled build"):
        compiled.decide("1", tmp_path / "none")


def test_a_fresh_build_is_used_unless_turned_off(tmp_path):
    build = _fake_build(tmp_path / "build")
    assert compiled.unusable_reason(build) is None
    assert compiled.decide("", build)
    assert compiled.decide(" 1 ", build)
    assert not compiled.decide("0", build)


def test_an_edited_source_makes_the_build_stale(tmp_path, caplog):
    digests = compiled.source_digests()
    digests["dualpath.sim.links"] = "0" * 64  # compiled from another links.py
    build = _fake_build(tmp_path / "build", digests=digests)
    with caplog.at_level(logging.WARNING, logger="dualpath.compiled"):
        assert not compiled.decide("", build)
    assert "links.py of dualpath.sim.links changed" in caplog.text
    with pytest.raises(ImportError, match="links.py of dualpath.sim.links changed"):
        compiled.decide("1", build)


def test_other_interpreters_and_unfinished_builds_are_not_used(tmp_path, caplog):
    other = _fake_build(tmp_path / "other", python="cpython-399")
    assert "cpython-399" in compiled.unusable_reason(other)
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()  # compiled, but the build stopped before its manifest
    with caplog.at_level(logging.WARNING, logger="dualpath.compiled"):
        assert not compiled.decide("", unfinished)
    assert "no compiled build" in caplog.text
    digests = compiled.source_digests()
    del digests["dualpath.sim.events"]
    fewer = _fake_build(tmp_path / "fewer", digests=digests)
    assert "other modules" in compiled.unusable_reason(fewer)
    (fewer / compiled.MANIFEST_NAME).write_text("{not json")
    assert "unreadable manifest" in compiled.unusable_reason(fewer)


def test_a_bad_setting_is_an_error(tmp_path):
    with pytest.raises(ImportError, match="must be 0, 1 or unset, got 'yes'"):
        compiled.decide("yes", tmp_path)


def test_the_finder_serves_only_compiled_modules_of_a_used_build():
    finder = next(f for f in sys.meta_path if isinstance(f, compiled._CompiledFinder))
    assert finder.find_spec("dualpath.sim.runner") is None  # never compiled
    spec = finder.find_spec("dualpath.sim.links")
    shared = finder.find_spec(f"{compiled.GROUP_NAME}__mypyc")
    if compiled.is_active():
        assert spec.origin.endswith(importlib.machinery.EXTENSION_SUFFIXES[0])
        assert shared.origin.startswith(str(compiled.build_dir()))
    else:
        assert spec is None and shared is None
    # Never through sys.path, where the build's dualpath/ folder would shadow the package
    # as a namespace in a process that imports it afresh (a --jobs worker).
    assert str(compiled.build_dir()) not in sys.path


_RUN = """
import json
from dualpath import compiled
from dualpath.sim.runner import RunSpec, run_simulation
results = {}
for mode in ("basic", "dualpath", "oracle"):
    r = run_simulation(RunSpec(nodes="2P4D", num_agents=1024, mode=mode, scale_down=8))
    results[mode] = [r.jct_s.hex(), r.num_events, r.snic_load_balance.hex()]
print(json.dumps({"active": compiled.is_active(), "results": results}))
"""


def _run(setting: str) -> dict:
    env = dict(os.environ, DUALPATH_COMPILED=setting)
    out = subprocess.run([sys.executable, "-c", _RUN], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


@pytest.mark.skipif(
    not compiled.is_active(), reason="no compiled build in use (`make test-compiled` runs it)"
)
def test_the_compiled_build_changes_no_result():
    from dualpath.sim import links, simulator

    for module in (links, simulator):
        assert module.__file__.endswith(importlib.machinery.EXTENSION_SUFFIXES[0])
    compiled_run, source_run = _run("1"), _run("0")
    assert compiled_run["active"] and not source_run["active"]
    assert compiled_run["results"] == source_run["results"]
