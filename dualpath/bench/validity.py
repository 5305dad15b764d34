"""Whether a benchmark run is a result: every request succeeded, every turn ran, every mode
generated the same tokens, and the hit KV read equals what the cached tokens hold.

    problems = mode_problems("dualpath", result)  # [] for a clean run
    mark_validity(report, problems)  # "valid", "problems"; no "ratios" unless valid

A failed request ends its agent, so the figures of a run with failures describe a smaller,
different workload (the requests that failed are often the longest), and ratios between modes
that lost different requests compare nothing. Such a run exits non-zero, says why, and
writes its JSON with ``"valid": false`` and no ratios (STYLE.md §6: a result that could be
broken must say so).
"""

from __future__ import annotations

MAX_ERRORS_SHOWN = 3  # failed turns quoted per mode in a problem (the count is always given)
# On kernel-shaped links (``kernel_links.py``) a mode is a result only where each NIC's
# counters and our accounting of the same NIC agree this closely, or differ by fewer bytes than
# a NIC carries unasked over a run (the file system's keep-alive pings, ARP): half a block of
# the tiny model.
MAX_COUNTER_DISAGREEMENT = 0.05
COUNTER_NOISE_BYTES = 64 * 1024


def mode_problems(
    label: str,
    result: dict,
    *,
    reference: str | None = None,
    kv_bytes_per_token: int | None = None,
) -> list[str]:
    """Why one mode's (or probe's, or calibration's) result is not a result; [] if it is.
    ``reference`` names the mode whose tokens ``token_mismatches`` counts against. With
    ``kv_bytes_per_token``, the hit KV the two sides read (``path_bytes``, when the servers
    report it) must be exactly the cached tokens' KV: each hit block read once, by one side,
    unless the prefill engine still held it in its own prefix cache (``engine_cached_bytes``,
    vLLM engines). The cached tokens are the server's count of store hits
    (``store_hit_tokens``) where it reports one, else the answers' ``cached_tokens``; a request
    a front door placed again reads its hits again, so those of its later placements count too
    (``replaced_hit_tokens``). On kernel-shaped links each NIC's counters must agree with our
    accounting (``nic_problems``)."""
    problems = []
    num_failed = result.get("num_failed", 0)
    if num_failed:
        errors = "; ".join(
            f"session {e['session']} turn {e['turn']}: {e['error']}"
            for e in result.get("first_errors", [])[:MAX_ERRORS_SHOWN]
        )
        problems.append(
            f"{label}: {num_failed} of {result['num_requests']} requests failed "
            f"(each ends its agent), first: {errors}"
        )
    elif not result.get("is_complete", True):
        problems.append(
            f"{label}: incomplete, {result['num_requests']} of "
            f"{result.get('num_turns_expected', '?')} turns ran"
        )
    path_bytes = result.get("path_bytes")
    if kv_bytes_per_token is not None and path_bytes is not None:
        read_bytes = sum(path_bytes.values())
        held_bytes = result.get("engine_cached_bytes") or 0
        hit_tokens = store_hit_tokens(result)
        replaced_tokens = result.get("replaced_hit_tokens") or 0
        expected_bytes = (hit_tokens + replaced_tokens) * kv_bytes_per_token
        if read_bytes + held_bytes != expected_bytes:
            held = f" (and {held_bytes} B the engine held)" if held_bytes else ""
            replaced = (
                f" (and {replaced_tokens} of placements made again)" if replaced_tokens else ""
            )
            problems.append(
                f"{label}: the sides read {read_bytes} B of hit KV{held}, but "
                f"{hit_tokens} cached tokens{replaced} hold {expected_bytes} B "
                f"({kv_bytes_per_token} B per token)"
            )
    problems += nic_problems(label, result)
    if result.get("token_mismatches"):
        problems.append(
            f"{label}: {result['token_mismatches']} turns generated other tokens than "
            f"{reference or 'the first mode'}"
        )
    return problems


def nic_problems(label: str, result: dict) -> list[str]:
    """Kernel-shaped links: the NICs whose counters and our accounting (with the store's
    measured protocol bytes on a storage NIC: ``kernel_links.nic_figures``) are more than
    ``MAX_COUNTER_DISAGREEMENT`` and ``COUNTER_NOISE_BYTES`` apart; [] without test hosts."""
    problems = []
    for nic, row in (result.get("nic_agreement") or {}).items():
        ratio = row["ratio"]
        expected = row["our_bytes"] + row["protocol_bytes"]
        if abs(row["counters_bytes"] - expected) <= COUNTER_NOISE_BYTES:
            continue
        if ratio is None or abs(ratio - 1) > MAX_COUNTER_DISAGREEMENT:
            problems.append(
                f"{label}: {nic}'s counters moved {row['counters_bytes']} B against "
                f"{row['our_bytes']} B in our accounting of {row['link']} and "
                f"{row['protocol_bytes']} B of the store's protocol (ratio {ratio}; the limit is "
                f"{MAX_COUNTER_DISAGREEMENT:.0%} either way)"
            )
    return problems


def store_hit_tokens(result: dict) -> int:
    """The prompt tokens a mode's server placed as store hits: its own count where it reports
    one, else the answers' ``cached_tokens`` (the same for our engines)."""
    hit_tokens = result.get("store_hit_tokens")
    return result["cached_tokens"] if hit_tokens is None else hit_tokens


def mark_validity(report: dict, problems: list[str]) -> dict:
    """Record ``valid`` and ``problems`` in ``report``; an invalid report keeps no ratios."""
    report["valid"] = not problems
    report["problems"] = list(problems)
    if problems and "ratios" in report:
        report["ratios"] = {}
    return report


def invalid_message(report: dict) -> str:
    """What a command prints (stderr) before it exits non-zero on an invalid report."""
    num = len(report["problems"])
    lines = [f"invalid run ({num} problem{'' if num == 1 else 's'}); no ratio is a result:"]
    lines += [f"  - {problem}" for problem in report["problems"]]
    return "\n".join(lines)
