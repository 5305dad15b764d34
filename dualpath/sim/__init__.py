"""dualpath.sim: a discrete-event simulator of a DualPath cluster that runs the real scheduler.

    dualpath simulate --experiment offline-jct        # SPEC §7 figures, table + JSON + PNG
    dualpath plan --model deepseek-v3.2-660b --agents 2048

No torch: engines, links and storage are models (``docs/simulator.md``).
"""
