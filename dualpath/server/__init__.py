"""dualpath.server: the OpenAI-compatible HTTP API in front of a PD-disaggregated cluster.

    dualpath serve                      # embedded default: SmolLM2-135M-Instruct, 1P2D, :8000
    curl localhost:8000/v1/completions -H "Content-Type: application/json" \
        -d '{"model": "smollm2-135m-instruct", "prompt": "def fib(n):"}'

One process runs the scheduler (``LocalCluster``'s loop thread) and this API (FastAPI on
uvicorn, one asyncio loop); every engine is its own process. Modules, outside in:

    serve.py        run uvicorn, translate SIGINT/SIGTERM into a graceful stop
    app.py          the FastAPI app: lifespan (starts and closes the cluster), /health, /metrics
    middleware.py   request ids, arrival times, HTTP metrics; the request-size limit
    routes.py       /v1/models, /v1/completions, /v1/chat/completions, /tokenize, /detokenize
    anthropic_*.py  /v1/messages, Anthropic's API: requests as chat messages, its bodies and
                    events, its errors, and forwarding it as a chat request
    generation.py   one API call's engine requests: events in, text deltas out
    forwarding.py   the same routes when the engines are vLLM servers: requests forwarded to them
    forwarded_*.py  one forwarded call: placements, the relayed stream, going on elsewhere
    vllm_servers.py the HTTP client to vLLM server engines
    responses.py    OpenAI's response bodies and stream chunks
    tool_calls.py   Hermes/Qwen-style tool calls found in a chat output, streamed or whole
    protocol.py     request bodies (pydantic) and their mapping to ``SamplingParams``
    chat.py         chat messages -> prompt text through the checkpoint's template
    detokenizer.py  incremental text with stop strings and stop tokens handled
    context.py      ``ServingContext``: what the routes share; the bounded waiting queue
    metrics.py      Prometheus metrics, one registry per app: the request series
    cluster_metrics.py  the cluster's series, read from the scheduler's snapshot on a scrape
    vllm_metrics.py the request series under vLLM's names too (vLLM dashboards)
    errors.py       OpenAI's error shape and the one place statuses are chosen
    config.py       ``ServerConfig``; args.py: the ``serve`` flags and ``--config FILE``
"""
