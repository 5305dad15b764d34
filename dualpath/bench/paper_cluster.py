"""The paper's 48P96D cluster as the scheduler benchmarks model it (SPEC §7, "scale").

``scheduler_bench`` places requests on it with the policy alone; ``scheduler_wire`` and its
simulated group leaders (``wire_leaders``) drive the real scheduler process with it.
"""

from __future__ import annotations

PREFILL_NODE_SHARE = 3  # one node in three is a prefill node: 1P:2D, as 48P96D
# DeepSeek-V3.2's KV, ~656 bytes per token per layer x 61 layers (SPEC §7).
KV_BYTES_PER_TOKEN = 656 * 61
SNIC_BANDWIDTH_GBPS = 400.0  # one 400 Gbps storage NIC per node (SPEC §1)
# A DE's KV memory: ~60 GB of an H200 at ~40 KB/token is ~1.5M tokens, in 64-token blocks.
DECODE_KV_CAPACITY_BLOCKS = 1_500_000 // 64
PAPER_REQUESTS_PER_S = 2350.0  # what 48P96D served in the paper
