"""`dualpath bench scheduler --wire` on a small cluster: counts, not timings."""

from __future__ import annotations

import json
from pathlib import Path

from dualpath.cli import main

EXPECTED_KEYS = {
    "placement",
    "placements_per_s",
    "cpu_s_per_placement",
    "placements_per_cpu_s",
    "cores_at_2350_rps",
    "projected_cores_at_2350_rps",
    "cpu_s_per_report",
    "cpu_s_per_placement_beyond_reports",
    "loop_cores",
    "loop_turns_per_s",
    "submit_cpu_s_per_request",
    "requests_per_s_target",
    "requests_per_s_submitted",
    "duration_s",
    "num_placed_in_window",
    "num_submitted",
    "num_assigned",
    "is_consistent",
    "num_prefill_assignments_received",
    "num_decode_assignments_received",
    "num_misrouted_assignments",
    "group_reports_per_s",
    "group_reports_per_s_target",
    "num_late_reports",
    "messages",
    "mean_prompt_tokens",
    "hit_fraction",
    "mean_output_tokens",
    "cluster",
    "num_engines",
    "num_leaders",
    "engines_per_node",
    "nodes_per_group",
    "fetch_interval_s",
    "link_bytes_interval_s",
    "loop_turn_s",
    "seed",
    "profile",
    "hardware",
}


def test_every_request_reaches_one_prefill_and_one_decode_leader_once(tmp_path: Path) -> None:
    out = tmp_path / "wire.json"
    # 2P4D at 8 engines per node: 48 engines, 6 leaders (one node per group).
    argv = ["bench", "scheduler", "--wire", "--engines", "48", "--duration-s", "1.5"]
    argv += ["--requests-per-s", "100", "--context-tokens", "4096", "--json", str(out)]
    assert main(argv) == 0
    result = json.loads(out.read_text())

    assert set(result) == EXPECTED_KEYS
    assert (result["cluster"], result["num_engines"], result["num_leaders"]) == ("2P4D", 48, 6)
    assert result["num_submitted"] > 0 and result["num_placed_in_window"] > 0
    # Each submitted request was placed once, and its Assignment reached its PE's leader and
    # its DE's leader exactly once each, naming the same pair (checked inside the bench).
    assert result["is_consistent"]
    assert (
        result["num_assigned"]
        == result["num_prefill_assignments_received"]
        == result["num_decode_assignments_received"]
        == result["num_submitted"]
    )
    assert result["num_misrouted_assignments"] == 0
    messages = result["messages"]
    assert messages["GroupInfo"]["count"] == 6
    assert messages["Assignment"]["count"] == 2 * result["num_submitted"]
    assert messages["GroupReport"]["count"] > 0
    assert result["cpu_s_per_placement"] > 0 and result["placements_per_cpu_s"] > 0
    assert result["cpu_s_per_report"] > 0 and result["projected_cores_at_2350_rps"] > 0
