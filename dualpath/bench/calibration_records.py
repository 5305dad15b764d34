"""Recorded SNIC calibrations: a preset's caps fixed once per machine kind, not per run.

A calibrated preset (``paper-ratio``, ``agentic``, ``--rho``) sets each node's SNIC cap to the
hit-KV rate a PE consumes at its prefill speed over rho (``calibration.py``). Measured afresh
in every run, that rate is one uncapped run's, on a shared host: the caps of one preset on
one machine spread 0.28-0.51 Gbps across runs, and the DualPath/Basic ratio with them
(1.31x-2.34x on vLLM engines). A ratio is only comparable between runs whose caps are the same.

So a calibration is recorded: ``--calibration record`` runs the uncapped calibration
``--calibration-runs`` times and keeps the run of median caps, under a key of everything the
rate depends on (``calibration_key``): the machine kind (architecture, CPU model, core
count), the engines as the benchmark starts them (engine kind, topology, KV memory,
transport, read path, vLLM settings), the model's config and the workload's exact turns
(preset, shaping, seed), and rho. The default, ``--calibration recorded``, uses a record
whose key matches and calibrates in the run otherwise; ``--calibration run`` always
calibrates in the run. The report says which (``calibration_source``).

Records are read from the user's file (``$DUALPATH_HOME/bench/calibrations.json``, where
``record`` writes) and then from the package's (``data/calibrations.json``: the machine kinds
the project measured on, each record with its command and date).
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
from dataclasses import fields
from pathlib import Path

from dualpath.bench.hardware import hardware_info
from dualpath.bench.harness import ModeRun
from dualpath.home import data_home
from dualpath.workload import Workload

PACKAGED_RECORDS = Path(__file__).with_name("data") / "calibrations.json"
# A ModeRun's fields that the calibration sets or that differ between the runs it serves; the
# test hosts are keyed by what they are (``links``): on kernel-shaped links the transport's
# TCP and the store's file system cost the hosts' CPU, and the PE's rate differs.
_NOT_KEYED = ("mode", "model_dir", "snic_bandwidth_gbps", "prefill_tokens_per_s", "testbed")


def user_records_path() -> Path:
    return data_home() / "bench" / "calibrations.json"


def machine_kind() -> dict:
    """What makes two hosts the same kind for a calibration."""
    facts = hardware_info()
    return {key: facts[key] for key in ("machine", "cpu_model", "cpu_count")}


def workload_digest(workload: Workload) -> str:
    """The workload's exact turns: every appended token, output length and prefix cut."""
    digest = hashlib.sha256()
    for session in workload.sessions:
        digest.update(session.session_id.encode() + b"\0")
        for turn in session.turns:
            digest.update(turn.append_token_ids.tobytes())
            digest.update(f"|{turn.output_tokens}|{turn.keep_prefix_tokens}|".encode())
    return digest.hexdigest()


def calibration_key(base: ModeRun, rho: float, workload: Workload) -> dict:
    """Everything the calibrated rate depends on (module docstring), readable."""
    config = json.loads((Path(base.model_dir) / "config.json").read_text())
    engines = {f.name: getattr(base, f.name) for f in fields(base) if f.name not in _NOT_KEYED}
    engines["vllm_args"] = [list(pair) for pair in base.vllm_args]
    engines["extra_serve_args"] = list(base.extra_serve_args)
    if base.links != "emulated":  # the keys recorded before links were a choice stay valid
        engines["links"] = base.links
    return {
        "machine": machine_kind(),
        "engines": engines,
        "model_config_sha256": hashlib.sha256(
            json.dumps(config, sort_keys=True).encode()
        ).hexdigest(),
        "workload": {"source": workload.source, "sha256": workload_digest(workload)},
        "rho": rho,
    }


def key_id(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


def find_record(key: dict) -> tuple[dict, Path] | None:
    """The first record under ``key`` in the user's file, then the package's; None if none."""
    wanted = key_id(key)
    for path in (user_records_path(), PACKAGED_RECORDS):
        record = _read(path).get(wanted)
        if record is not None and record.get("key") == key:
            return record, path
    return None


def median_calibration(calibrations: list[dict]) -> dict:
    """Of several calibration runs', the one whose caps are the median (the lower middle of an
    even count), with every run's caps and their spread ((max - min) / median) beside it."""
    ranked = sorted(calibrations, key=lambda c: c["snic_caps_gbps"])
    chosen = dict(ranked[(len(ranked) - 1) // 2])
    caps = [c["snic_caps_gbps"] for c in calibrations]
    chosen["calibration_runs_caps_gbps"] = caps
    chosen["calibration_runs_caps_spread"] = (max(caps) - min(caps)) / statistics.median(caps)
    return chosen


def write_record(key: dict, calibration: dict, command: str, path: Path | None = None) -> Path:
    """Record ``calibration`` under ``key`` (replacing an older one) in the user's file."""
    path = user_records_path() if path is None else path
    records = _read(path)
    records[key_id(key)] = {
        "key": key,
        "calibration": calibration,
        "command": command,
        "recorded_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(records, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)  # a reader never sees half a file
    return path


def _read(path: Path) -> dict:
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(
            f"calibration records {path} are not JSON ({exc}): fix or remove it"
        ) from None
    if not isinstance(records, dict):
        raise ValueError(f"calibration records {path}: expected a JSON object of records")
    return records
