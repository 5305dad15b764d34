"""Count the functions one request runs through, in every process of a local cluster.

    python scripts/request_path.py [--json OUT]

A 1P1D ``LocalCluster`` on a random-weight ``tiny`` checkpoint runs twice: once idle (start,
a pause, stop) and once serving one request (start, the request, the same pause, stop). In
every process (the scheduler's and each engine's) a profile hook records which functions of
the ``dualpath`` package ran; the functions that ran only in the second run are the request's
path: the hops from ``LocalCluster.submit`` through the scheduler, both engines and back to
the caller's tokens. Named functions only (no lambdas or comprehensions). Functions that also
run without a request (start-up, reports, the codec) are not counted, so the figure is a
floor, and the same floor for any two versions of the code. Run it on two checkouts to compare them (``PYTHONPATH`` picks the tree).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from collections import Counter
from pathlib import Path

# Installed as ``sitecustomize`` in every process: records (file, function) of the package's
# code run by any thread, written at exit.
_HOOK = textwrap.dedent(
    """
    import atexit, json, os, sys, threading
    _out = os.environ.get("DUALPATH_TRACE_DIR")
    if _out:
        _seen = set()
        _marker = os.sep + "dualpath" + os.sep

        def _profile(frame, event, arg):
            if event == "call":
                code = frame.f_code
                if _marker in code.co_filename and "<" not in code.co_qualname:
                    _seen.add((code.co_filename.rsplit(_marker, 1)[1], code.co_qualname))

        sys.setprofile(_profile)
        threading.setprofile(_profile)

        @atexit.register
        def _dump():
            path = os.path.join(_out, f"{os.getpid()}.json")
            with open(path, "w") as f:
                json.dump(sorted(_seen), f)
    """
)

_RUN = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from dualpath.cluster.launcher import LocalCluster
    from dualpath.config import ClusterConfig, KVStoreConfig
    from dualpath.types import SamplingParams

    model_dir, store_dir, serve = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1"
    cluster = LocalCluster(
        ClusterConfig(num_prefill_nodes=1, num_decode_nodes=1, nodes_per_group=1),
        model_dir=model_dir,
        store=KVStoreConfig(root_dir=store_dir),
    )
    with cluster:
        if serve:
            (output,) = cluster.generate([list(range(1, 200))], SamplingParams(max_tokens=8))
            assert output.finish_reason == "length", output
        time.sleep(1.0)
    """
)


def _trace(model_dir: Path, serve: bool) -> dict[str, set[tuple[str, str]]]:
    """Per process kind ("scheduler", "engines"): the functions that ran."""
    with tempfile.TemporaryDirectory(prefix="dualpath-path-") as temp:
        hook_dir, trace_dir = Path(temp, "hook"), Path(temp, "trace")
        hook_dir.mkdir()
        trace_dir.mkdir()
        (hook_dir / "sitecustomize.py").write_text(_HOOK)
        env = dict(os.environ, DUALPATH_TRACE_DIR=str(trace_dir))
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir), env.get("PYTHONPATH")]))
        argv = [sys.executable, "-c", _RUN, str(model_dir), str(Path(temp, "kv")), "1" * serve]
        completed = subprocess.run(argv, env=env, capture_output=True, text=True)
        if completed.returncode != 0:
            raise SystemExit(f"the cluster run failed:\n{completed.stderr[-3000:]}")
        scheduler_pid = None
        seen: dict[str, set[tuple[str, str]]] = {"scheduler": set(), "engines": set()}
        for path in trace_dir.glob("*.json"):
            functions = {tuple(f) for f in json.loads(path.read_text())}
            is_scheduler = ("cluster/launcher.py", "LocalCluster.__init__") in functions
            if is_scheduler:
                scheduler_pid = path.stem
            seen["scheduler" if is_scheduler else "engines"] |= functions
        if scheduler_pid is None:
            raise SystemExit("no trace from the scheduler process")
        return seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, default=None, help="write the counts and paths")
    parser.add_argument(
        "--model", type=Path, default=None, help="checkpoint (default: a tiny random one)"
    )
    args = parser.parse_args()
    from dualpath.model.make import make_model

    with tempfile.TemporaryDirectory(prefix="dualpath-model-") as temp:
        model_dir = args.model or make_model("tiny", Path(temp) / "tiny", seed=0)
        idle = _trace(model_dir, serve=False)
        served = _trace(model_dir, serve=True)
    result = {}
    for kind in ("scheduler", "engines"):
        path = sorted(served[kind] - idle[kind])
        files = Counter(f for f, _ in path)
        result[kind] = {
            "num_functions": len(path),
            "num_files": len(files),
            "functions": [f"{f}:{name}" for f, name in path],
        }
        print(f"{kind}: {len(path)} functions in {len(files)} files run for the request")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
