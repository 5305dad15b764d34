"""vLLM as a dualpath engine (SPEC §9): our KV connector on vLLM's paged cache.

    layouts.py     vLLM's pages per attention backend (CPU, MLA, GPU layouts) as ``KVPages``
                   adapters, chosen from what vLLM registers
    cache.py       vLLM's CPU attention page packing, checked against vLLM's own op at start
    connector.py   ``DualpathConnector`` (vLLM's ``KVConnectorBase_V1``): a scheduler side that
                   plans each step, a worker side whose layer hooks call our ``KVCourier``
    engine.py      the in-process vLLM engine (cores, connector, prefix-cache probe, profile)
                   and the requests we give it (sampling parameters naming a transfer)
    prefill.py     a PE on vLLM, behind ``dualpath.engine.role``'s ``RoleEngine``
    decode.py      a DE on vLLM, behind the same interface
    roles.py       ``make_vllm_role``: the vLLM engine and the role an engine process runs
    llm.py         ``VllmLLM``: one engine with the store behind it (``generate --engine vllm``)

Everything here imports ``vllm`` (``make test-vllm`` builds a venv with it), and nothing here
imports the cluster, the server, the benchmarks or the simulator. The rest of the package
imports this package only lazily, inside functions: ``cluster/engine_process``
(``roles.make_vllm_role``, ``--engine vllm``), ``cli/generate`` (``llm.VllmLLM``) and
``bench/store_bench`` (``layouts.CpuAttentionPages``).
"""
