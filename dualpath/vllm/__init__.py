"""vLLM as a dualpath engine (SPEC §9): our KV connector on vLLM's paged cache.

    cache.py       vLLM's CPU pages <-> our Layer and Full Blocks (the byte order of the store
                   and the buffers), checked against vLLM's own packing at start
    connector.py   ``DualpathConnector`` (vLLM's ``KVConnectorBase_V1``): hit KV loaded into
                   vLLM's blocks per layer, every layer's KV sent to a decode engine's buffer,
                   a decode engine's prompt KV loaded from its buffer, full blocks persisted
    engine.py      the in-process vLLM engine (cores, connector, prefix-cache probe, profile)
                   and the requests we give it (sampling parameters naming a connector plan)
    roles.py       a PE and a DE on vLLM behind ``dualpath.engine.role``'s ``RoleEngine``
    llm.py         ``VllmLLM``: one engine with the store behind it (``generate --engine vllm``)

Everything here imports ``vllm`` (``make test-vllm`` builds a venv with it), and nothing here
imports the cluster, the server, the benchmarks or the simulator. The rest of the package
imports this package only lazily, inside functions: ``cluster/engine_process``
(``roles.make_vllm_role``, ``--engine vllm``), ``cli/generate`` (``llm.VllmLLM``) and
``bench/store_bench`` (``layouts.CpuAttentionPages``).
"""
