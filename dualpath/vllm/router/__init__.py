"""The router in front of vLLM servers (``dualpath serve --external-engines``): the generation
routes that forward a request to the vLLM OpenAI servers our scheduler placed it on.

    forwarding.py            the routes: the client's raw JSON, tokenized by a server, placed
    local_prompts.py         a chat's prompt rendered here, once seen to match the servers'
    forwarded_call.py        one forwarded call: its response, and going on after a lost placement
    forwarded_placements.py  a call's placements: submitted, sent to the DE then the PE, read back
    forwarded_stream.py      the client's SSE stream, continued from another DE when one is lost
    vllm_servers.py          the HTTP client to the servers (/tokenize, /health, /v1/models, POSTs)

It speaks HTTP to vLLM servers and imports no ``vllm``: the router runs in any venv.
"""
