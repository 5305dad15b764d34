"""Benchmarks against and on vLLM (``dualpath bench``'s vLLM parts).

    served_cluster.py   DualPath inside vLLM servers on this host: one vLLM OpenAI server per
                        engine (``dualpath vllm-config``), ``dualpath serve --external-engines``
    served_run.py       a benchmark mode on such a cluster (``bench offline|online --vllm-servers``)
    vllm_compare.py     ``bench vs-vllm``: real sessions against vLLM alone, vLLM's P/D and ours
                        (``--regime``: ``dualpath/bench/regimes.py``)
    vllm_systems.py     vLLM's own systems of ``vs-vllm``: one instance, or its P/D and proxy
    pd_proxy.py         the router in front of vLLM's own P/D pair (``vs-vllm``'s baseline)
    engine_bench.py     vLLM's engine in ``bench engine --engines ...,vllm``

Only ``engine_bench.py`` imports ``vllm`` (lazily, in the process that runs it); the others
start vLLM servers and speak HTTP to them.
"""
