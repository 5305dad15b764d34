"""The ``local`` profile: this machine as ``dualpath bench offline`` runs it, from measurements.

``dualpath.bench.sim_profile`` times the real engine's model (prefill vs (cached, new),
decode step vs batch, a host copy rate) and writes a JSON file; ``load_local_profile`` reads
it into a ``LocalProfile``: a ``ProfiledCostModel`` plus the links of the emulated cluster.

Assumptions, stated (nothing is fitted to a benchmark run):

* one engine per node (``dualpath serve --nodes 1P2D`` runs one engine process per node);
* the SNIC is the benchmark's emulated cap (a token bucket: exact, so no storage efficiency);
  the CNIC is the measured host copy rate (engines on one host move KV through shared
  memory);
* **engines share the machine's cores**: ``num_engines`` processes of one torch thread each on
  ``num_cores`` cores, so every measured time is divided by ``min(1, num_cores /
  num_engines)`` (all engines busy is the offline benchmark's steady state).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_PROFILE_PATH = Path(__file__).with_name("local_profile.json")


def nonnegative_fit(rows: list[list[float]], times_s: list[float]) -> list[float]:
    """Least squares with coefficients >= 0 (active set: drop negatives and refit): the
    fits of the profile's costs (``dualpath.bench.sim_profile``, ``fidelity.fit_serving``)."""
    a = np.array(rows, dtype=float)
    y = np.array(times_s, dtype=float)
    active = list(range(a.shape[1]))
    coefficients = np.zeros(a.shape[1])
    while active:
        solution, *_ = np.linalg.lstsq(a[:, active], y, rcond=None)
        if (solution >= 0).all():
            coefficients[active] = solution
            break
        active = [i for i, value in zip(active, solution, strict=True) if value > 0]
    return [float(c) for c in coefficients]


@dataclass(frozen=True, slots=True)
class ProfiledCostModel:
    """Fitted costs of the real engine (``CostModel`` interface), seconds on one engine."""

    num_layers: int
    prefill_fixed_s: float
    prefill_s_per_new_token: float
    prefill_s_per_pair: float  # per (new token, key) pair, keys = cached + new / 2
    decode_fixed_s: float
    decode_s_per_seq: float
    decode_s_per_context_token: float
    slowdown: float = 1.0  # core sharing: every time is multiplied by this (>= 1)
    # What the engines do around the model (serving probes, ``fidelity.fit_serving``): a PE
    # batch's work per request and per hit token (assembling hit KV from the buffers, sending
    # each layer's KV, sampling), and the engine process's loop around a decode step.
    prefill_request_s: float = 0.0
    prefill_s_per_hit_token: float = 0.0
    decode_loop_s: float = 0.0

    def forward_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        """The model's forward alone (the microbenchmark's fit), before core sharing."""
        if not chunks:
            return 0.0
        return self.prefill_fixed_s + sum(
            self.prefill_s_per_new_token * n + self.prefill_s_per_pair * n * (c + n / 2)
            for c, n in chunks
        )

    def prefill_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        if not chunks:
            return 0.0
        around_s = sum(self.prefill_request_s + self.prefill_s_per_hit_token * c for c, _ in chunks)
        return self.slowdown * (self.forward_s(chunks) + around_s)

    def attention_layer_s(self, chunks: Sequence[tuple[int, int]]) -> float:
        # One layer's share of the forward without its fixed part (the engine's predictor
        # times a whole layer too, ``engine/profile.py``).
        if not chunks:
            return 0.0
        return self.slowdown * (self.forward_s(chunks) - self.prefill_fixed_s) / self.num_layers

    def decode_step_s(self, num_seqs: int, num_context_tokens: int) -> float:
        if num_seqs == 0:
            return 0.0
        return self.slowdown * (
            self.decode_fixed_s
            + self.decode_loop_s
            + self.decode_s_per_seq * num_seqs
            + self.decode_s_per_context_token * num_context_tokens
        )


@dataclass(frozen=True, slots=True)
class LocalProfile:
    """The cost model and link rates of one host emulating a cluster."""

    cost: ProfiledCostModel
    kv_bytes_per_token: int
    snic_bytes_per_s: float  # per node: the benchmark's emulated cap
    cnic_bytes_per_s: float  # per engine: the measured host copy rate
    kv_cache_bytes: float  # per engine (``dualpath serve``'s KV cache)
    # The serving path outside the engines (``fidelity.fit_serving``), per request: from the
    # client's send to the scheduler, and the PE -> DE hand-off. 0 in profiles without probes.
    turn_latency_s: float = 0.0
    handoff_s: float = 0.0


def load_local_profile(
    path: Path | None = None,
    *,
    snic_bytes_per_s: float,
    kv_cache_bytes: float,
    num_engines: int,
    num_cores: int,
) -> LocalProfile:
    """``LocalProfile`` from ``dualpath.bench.sim_profile``'s JSON (``ValueError`` if a field
    is missing)."""
    path = Path(path or DEFAULT_PROFILE_PATH)
    try:
        return local_profile_from_dict(
            json.loads(path.read_text()),
            snic_bytes_per_s=snic_bytes_per_s,
            kv_cache_bytes=kv_cache_bytes,
            num_engines=num_engines,
            num_cores=num_cores,
        )
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from exc


def local_profile_from_dict(
    data: dict,
    *,
    snic_bytes_per_s: float,
    kv_cache_bytes: float,
    num_engines: int,
    num_cores: int,
) -> LocalProfile:
    """``load_local_profile`` of an already parsed profile."""
    serving = data.get("serving", {})
    try:
        prefill, decode = data["prefill"], data["decode"]
        cost = ProfiledCostModel(
            num_layers=int(data["num_layers"]),
            prefill_fixed_s=prefill["fixed_s"],
            prefill_s_per_new_token=prefill["per_new_token_s"],
            prefill_s_per_pair=prefill["per_pair_s"],
            decode_fixed_s=decode["fixed_s"],
            decode_s_per_seq=decode["per_seq_s"],
            decode_s_per_context_token=decode["per_context_token_s"],
            slowdown=max(1.0, num_engines / num_cores),
            prefill_request_s=float(serving.get("prefill_request_s", 0.0)),
            prefill_s_per_hit_token=float(serving.get("prefill_s_per_hit_token", 0.0)),
            decode_loop_s=float(serving.get("decode_loop_s", 0.0)),
        )
        return LocalProfile(
            cost=cost,
            kv_bytes_per_token=int(data["kv_bytes_per_token"]),
            snic_bytes_per_s=snic_bytes_per_s,
            cnic_bytes_per_s=float(data["copy_bytes_per_s"]),
            kv_cache_bytes=kv_cache_bytes,
            turn_latency_s=float(serving.get("turn_latency_s", 0.0)),
            handoff_s=float(serving.get("handoff_s", 0.0)),
        )
    except KeyError as exc:
        raise ValueError(f"not a local profile (missing {exc})") from exc
