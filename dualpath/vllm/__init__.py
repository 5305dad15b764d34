"""vLLM as a dualpath engine (SPEC §9): our KV connector on vLLM's paged cache.

    cache.py       vLLM's CPU pages <-> our Layer and Full Blocks (the byte order of the store
                   and the buffers), checked against vLLM's own packing at start
    connector.py   ``DualpathConnector`` (vLLM's ``KVConnectorBase_V1``): hit KV loaded into
                   vLLM's blocks per layer, every layer's KV sent to a decode engine's buffer,
                   a decode engine's prompt KV loaded from its buffer, full blocks persisted

Everything here imports ``vllm`` (``make test-vllm`` builds a venv with it); nothing else in
the package imports this package.
"""
