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
    args.py        vLLM's flags and checks as our configs take them (``--engine vllm``,
                   ``dualpath vllm-config``'s JSON); imports no ``vllm``

A user's own vLLM server as an engine (``dualpath vllm-config``; docs/vllm.md §0):

    served.py            the connector vLLM loads by module path (``DualpathServedConnector``)
                         and the engine beside vLLM's worker (``dualpath engine``'s loop)
    served_scheduler.py  the connector's scheduler side, in vLLM's engine-core process
    served_mailbox.py    the sockets between the two sides
    router/              ``dualpath serve --external-engines``'s routes that forward requests to
                         those servers (HTTP only, no ``vllm`` import)
    bench/               the benchmarks against and on vLLM (``bench vs-vllm``, ``--vllm-servers``)

Everything in the package that imports ``vllm`` or speaks to a vLLM server is here, and no
module outside it imports ``vllm`` (``make test-vllm`` builds a venv with it; tests/test_imports.py
checks). The engine modules above (layouts to llm) import nothing of the cluster, the server,
the benchmarks or the simulator; ``served*.py`` sit in the cluster's layer, ``router/`` in the
server's and ``bench/`` in the benchmarks'. The rest of the package imports this package only
lazily, inside functions: ``cluster/engine_process`` (``roles.make_vllm_role``, ``--engine
vllm``), ``cli/generate`` (``llm.VllmLLM``), ``bench/store_bench`` (``layouts.CpuAttentionPages``),
``bench/engine_bench`` (``bench.engine_bench``), and the server's app (``router``, imported at
start: it needs no ``vllm``). ``dualpath.cluster.served`` is an alias of ``served.py`` for
``--kv-transfer-config`` JSON printed before it moved here.
"""
