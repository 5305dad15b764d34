"""An optional compiled build of the simulator's and the scheduler's hot modules (mypyc).

    make compiled             # mypyc + the C compiler: about 4 minutes on 2 cores
    DUALPATH_COMPILED=0 ...   # run the Python sources even when a fresh build exists
    DUALPATH_COMPILED=1 ...   # require the build: ImportError when it is missing or stale

The build is the same source compiled to C extensions by mypyc (as black and mypy ship
themselves): simulations run ~3x faster with identical results, bit for bit
(``make test-compiled`` runs the simulator's and the scheduler's tests against it). Nothing
needs it: without a build everything runs from the sources.

It lives in ``dualpath/_compiled/<interpreter tag>/``, beside the sources and never in their
place. ``import dualpath`` installs a finder (``install``) that, on the first import of a
compiled module, decides once per process whether to load the build: only if its manifest
records, for every compiled module, the SHA-256 of the source file now on disk. An edited
source is therefore never shadowed by an older build: everything then runs from the sources,
with one warning. All or nothing: compiled modules call each other natively, so a mix of
compiled and source modules of one build cannot run.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.machinery
import importlib.util
import json
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

# The hot paths of a simulation (``docs/simulator.md``, "Speed"); the scheduler whole, since
# compiled modules of one build call each other natively.
COMPILED_MODULES = (
    "dualpath.scheduler.attention_predictor",
    "dualpath.scheduler.batching",
    "dualpath.scheduler.cluster_view",
    "dualpath.scheduler.dualpath_policy",
    "dualpath.scheduler.fetching",
    "dualpath.scheduler.load_planner",
    "dualpath.scheduler.message",
    "dualpath.scheduler.round_robin",
    "dualpath.scheduler.thresholds",
    "dualpath.scheduler.topology",
    "dualpath.sim.cluster",
    "dualpath.sim.cost",
    "dualpath.sim.engines",
    "dualpath.sim.events",
    "dualpath.sim.fetch_ticks",
    "dualpath.sim.links",
    "dualpath.sim.prefill_step",
    "dualpath.sim.simulator",
)
GROUP_NAME = "dualpath_native"  # mypyc's shared library: ``<GROUP_NAME>__mypyc``, top level
MANIFEST_NAME = "manifest.json"
ENV_VAR = "DUALPATH_COMPILED"

_PACKAGE_DIR = Path(__file__).resolve().parent
_COMPILED = frozenset(COMPILED_MODULES)
_SERVED = _COMPILED | {f"{GROUP_NAME}__mypyc"}


def build_dir() -> Path:
    """Where ``make compiled`` puts the build for this interpreter."""
    return _PACKAGE_DIR / "_compiled" / sys.implementation.cache_tag


def source_path(module: str) -> Path:
    """The source file of a compiled module (``dualpath.sim.links`` -> ``.../sim/links.py``)."""
    return _PACKAGE_DIR.parent.joinpath(*module.split(".")).with_suffix(".py")


def source_digest(module: str) -> str:
    return hashlib.sha256(source_path(module).read_bytes()).hexdigest()


def source_digests() -> dict[str, str]:
    """Every compiled module's source digest, taken before a build starts (an edit made
    while it compiles then makes the build stale instead of slipping in unrecorded)."""
    return {module: source_digest(module) for module in COMPILED_MODULES}


def write_manifest(directory: Path, digests: dict[str, str], mypy_version: str) -> None:
    """Record what a finished build was compiled from (the build script's last step)."""
    manifest = {
        "python": sys.implementation.cache_tag,
        "mypy": mypy_version,
        "group": GROUP_NAME,
        "modules": digests,
    }
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def unusable_reason(directory: Path) -> str | None:
    """Why the build in ``directory`` cannot be used, or None when it can: it must exist,
    be finished (a manifest), be for this interpreter and these modules, and every module's
    source must be the one it was compiled from."""
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        return f"no compiled build in {directory} (`make compiled` builds one)"
    try:
        manifest = json.loads(manifest_path.read_text())
        python, modules = manifest["python"], manifest["modules"]
    except (ValueError, KeyError, TypeError) as error:
        return f"unreadable manifest {manifest_path}: {error}"
    if python != sys.implementation.cache_tag:
        return f"the build is for {python}, this interpreter is {sys.implementation.cache_tag}"
    if set(modules) != _COMPILED:
        return "the build compiled other modules than this version compiles"
    for module in COMPILED_MODULES:
        if modules[module] != source_digest(module):
            return f"{source_path(module).name} of {module} changed since the build"
    return None


def decide(setting: str, directory: Path) -> bool:
    """Whether to load the build in ``directory`` under ``DUALPATH_COMPILED=setting``:
    "" uses it when it can be used, "0" never, "1" always (ImportError when it cannot)."""
    setting = setting.strip()
    if setting not in ("", "0", "1"):
        raise ImportError(f"{ENV_VAR} must be 0, 1 or unset, got {setting!r}")
    if setting == "0":
        return False
    reason = unusable_reason(directory)
    if reason is None:
        return True
    if setting == "1":
        raise ImportError(f"{ENV_VAR}=1 but the compiled build cannot be used: {reason}")
    if directory.exists():
        # A build exists but is stale: say so (no build at all is the normal case).
        logger.warning("running the Python sources: %s; `make compiled` rebuilds it", reason)
    return False


@functools.cache  # one process, one answer
def is_active() -> bool:
    """Whether this process runs the compiled build (reported with simulation speeds)."""
    directory = build_dir()
    return decide(os.environ.get(ENV_VAR, ""), directory)


class _CompiledFinder:
    """A ``sys.meta_path`` finder: the build's extension for a compiled module when the build
    is used, else nothing (the normal finders load the source)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None):
        # The build's shared library is a top-level module, served here rather than through a
        # sys.path entry: the build directory on sys.path would make a process that imports
        # ``dualpath`` afresh with the parent's path (a worker, ``--jobs``) take the build's
        # ``dualpath/`` folder for a namespace package.
        if fullname not in _SERVED or not is_active():
            return None
        location = build_dir().joinpath(*fullname.split("."))
        suffix = importlib.machinery.EXTENSION_SUFFIXES[0]
        return importlib.util.spec_from_file_location(
            fullname, location.with_name(location.name + suffix)
        )


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once; ``import dualpath`` calls it). It
    decides nothing until a compiled module is imported."""
    if not any(isinstance(finder, _CompiledFinder) for finder in sys.meta_path):
        sys.meta_path.insert(0, _CompiledFinder())
