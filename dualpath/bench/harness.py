"""One benchmark run of one mode: a fresh cluster, agents over HTTP, its figures.

    result = run_mode(ModeRun(mode="dualpath", ...), workload, work_dir=...)

For each mode the harness starts a fresh server (a fresh store: every mode begins cold) with
the mode, the cluster shape and the emulated link caps, replays the workload through the
OpenAI-compatible API (``agents.run_agents``), samples ``/metrics`` for the SNICs' bytes over
time, and stops the server. ``oracle`` keeps its store on a memory file system (/dev/shm), so
every hit is served from memory (all hit KV is written during the run, into memory).

The cluster is ``dualpath serve`` with its engines below it, or, with ``engine``
"vllm-servers", DualPath inside vLLM servers: a vLLM OpenAI server per engine and ``dualpath
serve --external-engines`` in front (``served_run.py``). Either way the agents and the
``/metrics`` sampler talk to one URL, and the result is judged alike.

With a ``testbed`` (``--links kernel``) the cluster runs over test hosts whose NICs the kernel
caps, our token buckets off (``kernel_links.py``), and the result adds each NIC's counters
beside our accounting (``nic_bytes``, ``nic_agreement``) and the SNIC balance from them.

With ``url`` set, the agents run against that server instead (ours or any other
OpenAI-compatible one): the link figures are then None.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import tempfile
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from tqdm import tqdm

from dualpath.bench.agents import TurnRecord, run_agents
from dualpath.bench.kernel_links import KernelTestbed, NicSampler, nic_figures, no_nic_sampler
from dualpath.bench.mode_flags import SERVED_MODEL_NAME, serve_args
from dualpath.bench.process_cpu import ProcessCpu
from dualpath.bench.server_process import MetricsSampler, ServerProcess, metric_sum, snic_totals
from dualpath.bench.spec import VLLM_SERVERS
from dualpath.bench.stats import LinkSample, snic_load_balance, summarize_turns
from dualpath.config import mode_settings
from dualpath.units import bytes_per_s_to_gbps, gbps_to_bytes_per_s
from dualpath.vllm.bench.served_run import start_served
from dualpath.workload import Workload

logger = logging.getLogger(__name__)

# ``snic_load_balance_busy`` counts the windows whose mean SNIC moved at least this much of
# its cap.
BUSY_FRACTION_OF_CAP = 0.5


@dataclass(frozen=True, slots=True)
class ModeRun:
    """What to serve for one mode's run."""

    mode: str
    model_dir: Path
    nodes: str  # e.g. "1P2D"
    snic_bandwidth_gbps: float  # per node; 0 = uncapped
    cnic_bandwidth_gbps: float = 0.0
    read_path: str | None = None  # force one read path (None: the mode's)
    transport: str = "nixl"
    # Prompt tokens a PE gets through per second (the scheduler's beta = 5 s of it); None:
    # the server's default.
    prefill_tokens_per_s: float | None = None
    # The servers' longest prompt (serve --max-prompt-tokens); None: the context minus one.
    max_prompt_tokens: int | None = None
    # What runs the model in every engine (serve --engine), or "vllm-servers": vLLM servers
    # with dualpath's connector behind a front door (``served_run.py``).
    engine: str = "native"
    vllm_args: tuple[tuple[str, Any], ...] = ()  # with engine "vllm": serve --vllm-arg
    kv_cache_gb: float | None = None  # each engine's device KV memory (None: serve's default)
    vllm_prefill_batching: str = "vllm"  # with engine "vllm": serve --vllm-prefill-batching
    attention_quota_s: float | None = None  # the PEs' compute quota (None: serve's default)
    extra_serve_args: tuple[str, ...] = ()
    # The test hosts every mode runs on (``--links kernel``); None: one host, our caps.
    testbed: KernelTestbed | None = field(default=None, compare=False, repr=False)

    @property
    def links(self) -> str:
        """``--links``: "kernel" (test hosts, ``tc``) or "emulated" (our token buckets)."""
        return "emulated" if self.testbed is None else "kernel"


class ModeServers(Protocol):
    """A mode's started cluster, as ``run_mode`` drives it."""

    served_model_name: str  # the model id the agents request

    @property
    def url(self) -> str: ...  # the agents' and the /metrics sampler's server

    def process_cpu(self) -> ProcessCpu: ...  # its processes' cores, not started

    def stop(self) -> dict: ...  # stop it; the result's exit-code keys

    # Its NICs' counters over the run (``kernel_links``), or nothing without test hosts.
    def nic_sampler(self) -> AbstractContextManager[NicSampler | None]: ...


@dataclass(frozen=True, slots=True)
class ServeServers:
    """``dualpath serve``, its engines below it."""

    server: ServerProcess
    served_model_name: str = SERVED_MODEL_NAME

    @property
    def url(self) -> str:
        return self.server.url

    def process_cpu(self) -> ProcessCpu:
        return ProcessCpu(self.server.pid)

    def stop(self) -> dict:
        return {"server_exit_code": self.server.stop()}

    def nic_sampler(self) -> AbstractContextManager[None]:
        return no_nic_sampler()


def start_servers(
    run: ModeRun, store_dir: Path, log_dir: Path, memory_dir: Path | None = None
) -> ModeServers:
    """``run``'s cluster, its store in ``store_dir`` (in ``memory_dir``, where given) and its
    logs in ``log_dir``; returns once it serves."""
    if run.engine == VLLM_SERVERS:
        assert run.testbed is None, "caller bug: offline.check_engine refuses --vllm-servers"
        return start_served(run, store_dir, log_dir)
    if run.testbed is not None:
        return run.testbed.start(run, store_dir.name, log_dir, memory_dir)
    args = serve_args(run, store_dir, log_dir)
    return ServeServers(ServerProcess(args, log_path=log_dir / "serve.log").start())


def run_mode(
    run: ModeRun,
    workload: Workload,
    *,
    work_dir: Path,
    progress: bool = True,
    keep_records: bool = False,
    stop_after_s: float | None = None,
    gap_scale: float | None = None,
    max_gap_s: float | None = None,
    pause_s: float | None = None,
    metrics_period_s: float = 0.5,
) -> dict:
    """Serve ``run``, replay ``workload`` against it, and return the mode's figures (with
    ``keep_records``, also every turn's ``TurnRecord`` under ``"_records"``). With
    ``stop_after_s`` the agents stop then; ``"is_complete"`` says whether every turn ran,
    ``"first_errors"`` what the first failed turns answered. ``gap_scale``, ``max_gap_s``: wait
    the trace's gaps between turns, times this, at most that; ``pause_s``: wait this long after
    each answer (``agents.run_agents``). ``metrics_period_s``: how often ``/metrics`` is
    scraped for the SNICs' timeline (the final counters are read at the end either way)."""
    name = run.mode.replace("+", "-")
    memory_dir = _memory_dir() if mode_settings(run.mode).is_io_free else None
    store_dir = (memory_dir or work_dir) / f"kv-{name}"
    log_dir = work_dir / f"logs-{name}"
    try:
        servers = start_servers(run, store_dir, log_dir, memory_dir)
        try:
            cpu = servers.process_cpu().start()
            with (
                servers.nic_sampler() as nics,
                MetricsSampler(servers.url, period_s=metrics_period_s) as sampler,
            ):
                records, tokens = _replay(
                    servers.url,
                    workload,
                    run.mode,
                    progress,
                    model=servers.served_model_name,
                    stop_after_s=stop_after_s,
                    gap_scale=gap_scale,
                    max_gap_s=max_gap_s,
                    pause_s=pause_s,
                )
            final = sampler.last
            process_cpu = cpu.stop()
        finally:
            exit_codes = servers.stop()
    finally:
        if memory_dir is not None:
            shutil.rmtree(memory_dir, ignore_errors=True)
    result = summarize_turns(records)
    if result["num_failed"]:
        logger.warning("%s: the servers' logs are in %s", run.mode, log_dir)
    result.update(link_figures(final, sampler.samples, result["jct_s"], run.snic_bandwidth_gbps))
    if nics is not None:  # the balance from the kernel's counters; ours kept beside it
        result["snic_load_balance_accounting"] = result["snic_load_balance"]
        result.update(nic_figures(nics, final, store_on_network=memory_dir is None))
    result["links"] = run.links
    result["process_cpu"] = process_cpu
    result["store_in_memory"] = memory_dir is not None
    result.update(exit_codes)
    result.update(completion(records, workload))
    result["tokens"] = tokens
    if keep_records:
        result["_records"] = records
    return result


def run_against_url(
    url: str,
    model: str,
    workload: Workload,
    *,
    api_key: str | None,
    progress: bool = True,
    pause_s: float | None = None,
) -> dict:
    """The agents against an already running OpenAI-compatible server; no link figures."""
    records, tokens = _replay(
        url, workload, "url", progress, model=model, api_key=api_key, pause_s=pause_s
    )
    result = summarize_turns(records)
    result.update(link_figures({}, [], result["jct_s"]))
    result.update(completion(records, workload))
    result["tokens"] = tokens
    return result


MAX_ERRORS_KEPT = 5  # failed turns a result quotes (the count is in num_failed)


def completion(records: list[TurnRecord], workload: Workload) -> dict:
    """Whether every turn of ``workload`` ran, and the first failed turns (session id, turn,
    what the server answered): what makes a run a result or not (``validity.py``)."""
    num_turns = sum(s.num_turns for s in workload.sessions)
    failed = sorted((r for r in records if r.error is not None), key=lambda r: r.finish_s)
    return {
        "num_turns_expected": num_turns,
        "is_complete": len(records) == num_turns,  # a failed turn stops its agent
        "first_errors": [
            {"session": workload.sessions[r.session].session_id, "turn": r.turn, "error": r.error}
            for r in failed[:MAX_ERRORS_KEPT]
        ],
    }


def _replay(
    url: str,
    workload: Workload,
    label: str,
    progress: bool,
    *,
    model: str = SERVED_MODEL_NAME,
    api_key: str | None = None,
    stop_after_s: float | None = None,
    gap_scale: float | None = None,
    max_gap_s: float | None = None,
    pause_s: float | None = None,
) -> tuple[list[TurnRecord], dict[str, str]]:
    total = sum(s.num_turns for s in workload.sessions)
    with tqdm(total=total, desc=f"{label:>15}", unit="turn", disable=not progress) as bar:

        def on_turn(record: TurnRecord) -> None:
            bar.update(1)

        records = asyncio.run(
            run_agents(
                url,
                model,
                workload.sessions,
                api_key=api_key,
                on_turn=on_turn,
                stop_after_s=stop_after_s,
                gap_scale=gap_scale,
                max_gap_s=max_gap_s,
                pause_s=pause_s,
            )
        )
    failed = [r for r in records if r.error is not None]
    if failed:
        logger.warning("%s: %d turns failed, e.g. %s", label, len(failed), failed[0].error)
    tokens = {f"{r.session}/{r.turn}": r.output_digest for r in records if r.error is None}
    return records, tokens


def link_figures(
    scraped: dict[str, list[tuple[dict[str, str], float]]],
    samples: list[LinkSample],
    jct_s: float,
    snic_cap_gbps: float = 0.0,
) -> dict:
    """Per-SNIC bytes, bytes per read side, SNIC load balance and the PE's busy fraction
    (None where the server did not report them)."""
    if not scraped:
        return {
            "snic_bytes": None,
            "path_bytes": None,
            "engine_cached_bytes": None,
            "store_hit_tokens": None,
            "replaced_hit_tokens": None,
            "forwarded_replacements": None,
            "persist_waits": None,
            "persist_wait_expired": None,
            "snic_load_balance": None,
            "snic_load_balance_busy": None,
            "snic_read_load_balance": None,
            "pe_busy_fraction": None,
            "snic_timeline": None,
            "first_token_stages_s": None,
        }
    busy_s = metric_sum(scraped, "dualpath_engine_busy_seconds_total", role="prefill")
    num_prefill = sum(
        1
        for labels, _ in scraped.get("dualpath_engine_busy_seconds_total", ())
        if labels.get("role") == "prefill"
    )
    return {
        "snic_bytes": snic_totals(scraped),
        "path_bytes": {
            "pe": int(metric_sum(scraped, "dualpath_read_path_bytes_total", side="prefill")),
            "de": int(metric_sum(scraped, "dualpath_read_path_bytes_total", side="decode")),
        },
        # Hit KV no side read: the PE's engine (vLLM) still held it in its prefix cache.
        "engine_cached_bytes": int(metric_sum(scraped, "dualpath_engine_cached_bytes_total")),
        # Prompt tokens the server placed as store hits. The answers' cached_tokens say the
        # same for our engines; a vLLM server's answer counts its own (the KV its connector
        # loaded, the PE's prefill included, and its prefix cache's).
        "store_hit_tokens": int(metric_sum(scraped, "dualpath_cached_prompt_tokens_total")),
        # The store hits of the placements a front door made again (a vLLM server DE lost or
        # refusing): each reads its hits again, which store_hit_tokens (its first placement's)
        # does not count.
        "replaced_hit_tokens": int(metric_sum(scraped, "dualpath_replaced_hit_tokens_total")),
        "forwarded_replacements": int(metric_sum(scraped, "dualpath_forwarded_replacements_total")),
        # Turns that found their last turn's blocks still being written and waited for them,
        # and finished turns whose writes outlasted --persist-wait-s (their waiters were
        # placed with what the store held then: a hit short of the bound).
        "persist_waits": int(metric_sum(scraped, "dualpath_scheduler_persist_waits_total")),
        "persist_wait_expired": int(
            metric_sum(scraped, "dualpath_scheduler_persist_wait_expired_total")
        ),
        "snic_load_balance": snic_load_balance(samples),
        # The same over the windows in which the SNICs carried at least half their cap on
        # average: where storage bandwidth binds, the regime the read-side choice is for.
        # Elsewhere a window's max/avg measures bursts (a few blocks written by one DE while
        # the first turns compute, SPEC §2's writes being the DEs' alone). A diagnostic beside
        # SPEC §7's figure, not instead of it; None without a cap.
        "snic_load_balance_busy": (
            snic_load_balance(
                samples,
                min_mean_bytes_per_s=BUSY_FRACTION_OF_CAP * gbps_to_bytes_per_s(snic_cap_gbps),
            )
            if snic_cap_gbps > 0
            else None
        ),
        # The same over hit-KV reads alone: what the read-side choices balance.
        "snic_read_load_balance": snic_load_balance(samples, reads_only=True),
        "snic_timeline": snic_timeline(samples),
        # Time the PEs spent in prefill batches over the run's length (mean over PEs).
        "pe_busy_fraction": busy_s / max(num_prefill, 1) / jct_s if jct_s > 0 else None,
        "first_token_stages_s": first_token_stages(scraped),
    }


def first_token_stages(scraped: dict[str, list[tuple[dict[str, str], float]]]) -> dict:
    """The mean of each stage of the first token's path, as the server saw it: ``server``
    from its HTTP request to the first token it sent, and the scheduler's stages within
    (``dualpath_first_token_stage_seconds``); {} where the server reported none."""
    means = {}
    series = {"server": ("dualpath_time_to_first_token_seconds", {})} | {
        labels["stage"]: ("dualpath_first_token_stage_seconds", labels)
        for labels, _ in scraped.get("dualpath_first_token_stage_seconds_count", ())
    }
    for stage, (name, labels) in series.items():
        count = metric_sum(scraped, f"{name}_count", **labels)
        if count:
            means[stage] = round(metric_sum(scraped, f"{name}_sum", **labels) / count, 4)
    return means


def snic_timeline(samples: list[LinkSample]) -> dict:
    """Each SNIC's rate (Gbps) between consecutive samples, at the interval's end (seconds
    from the first sample): the data of the per-SNIC utilisation plot."""
    names = sorted({name for sample in samples for name in sample.snic_bytes})
    times_s, gbps = [], {name: [] for name in names}
    for before, after in zip(samples[:-1], samples[1:], strict=True):
        span_s = after.time_s - before.time_s
        if span_s <= 0:
            continue
        times_s.append(after.time_s - samples[0].time_s)
        for name in names:
            moved = after.snic_bytes.get(name, 0) - before.snic_bytes.get(name, 0)
            gbps[name].append(bytes_per_s_to_gbps(moved / span_s))
    return {"time_s": times_s, "gbps": gbps}


def token_mismatches(tokens: dict[str, str], reference: dict[str, str]) -> int:
    """Turns whose generated tokens differ from ``reference``'s (or that it lacks)."""
    return sum(digest != reference.get(key) for key, digest in tokens.items())


def _memory_dir() -> Path | None:
    """A fresh directory on a memory file system, or None (with a warning) if there is none."""
    shm = Path("/dev/shm")
    try:
        mounts = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        mounts = []
    if shm.is_dir() and any(line.split()[1:3] == ["/dev/shm", "tmpfs"] for line in mounts):
        return Path(tempfile.mkdtemp(prefix="dualpath-oracle-", dir=shm))
    logger.warning("no tmpfs at /dev/shm: the oracle's store stays on disk (page cache)")
    return None
