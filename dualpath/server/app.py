"""The FastAPI app: middleware, the lifespan that starts and stops the cluster, and the
operational routes (/health, /metrics, /version), which need no API key.

    app = build_app(context, on_fatal=stop_the_server)

HTTP comes up before the engines: /health answers 503 and generation routes answer 503 until
every engine has joined. Leaving the lifespan (uvicorn's shutdown) ends every request still
in flight and closes the cluster, whose engines flush their pending store writes.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import anyio
from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from dualpath import __version__
from dualpath.server.anthropic_routes import build_anthropic_router
from dualpath.server.cluster_metrics import link_totals
from dualpath.server.context import ServerState, ServingContext
from dualpath.server.errors import install_error_handlers
from dualpath.server.middleware import BodySizeLimitMiddleware, RequestContextMiddleware
from dualpath.server.openapi import install_openapi
from dualpath.server.responses_routes import build_responses_router
from dualpath.server.routes import build_router
from dualpath.vllm.router.forwarding import build_forwarding_router
from dualpath.vllm.router.local_prompts import LocalPrompts
from dualpath.vllm.router.vllm_servers import VLLMServers

logger = logging.getLogger(__name__)

_LINK_SAMPLE_INTERVAL_S = 1.0


def build_app(
    context: ServingContext,
    *,
    on_fatal: Callable[[], None],
    on_ready: Callable[[], None] | None = None,
) -> FastAPI:
    """``on_fatal`` is called (on the event loop) if the cluster cannot start; ``on_ready``
    once every engine has joined."""
    # Forwarding mode's client, open in the lifespan.
    local_prompts = None if context.chat is None else LocalPrompts(context.chat, context.tokenizer)
    servers = VLLMServers(
        context.cluster, served_model_name=context.model.name, local_prompts=local_prompts
    )
    app = FastAPI(
        title="dualpath",
        version=__version__,
        lifespan=_lifespan(context, servers, on_fatal, on_ready),
        docs_url=None,
        redoc_url=None,
    )
    install_error_handlers(app)
    # First: in forwarding mode its routes take the generation paths (``forwarding.py``).
    app.include_router(build_forwarding_router(context, servers))
    app.include_router(build_router(context))
    app.include_router(build_anthropic_router(context, servers))
    app.include_router(build_responses_router(context, servers))
    _add_operational_routes(app, context)
    install_openapi(
        app,
        served_model_names=[context.model.name],
        max_model_len=context.model.max_model_len,
        max_prompt_tokens=context.max_prompt_tokens,
        vocab_size=context.model.vocab_size,
        max_num_generations_per_request=context.config.max_num_generations_per_request,
        is_api_key_required=context.config.api_key is not None,
    )
    # Added last = outermost: every response, a 413 included, gets an id and is counted.
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=context.config.max_request_bytes)
    app.add_middleware(RequestContextMiddleware, metrics=context.metrics)
    app.state.context = context
    app.state.vllm_servers = servers
    return app


_HEALTH_STORE_COUNTERS = ("write_errors", "corrupt_blocks", "missing_on_read")


def _add_operational_routes(app: FastAPI, context: ServingContext) -> None:
    @app.get("/health")
    async def health() -> JSONResponse:
        snapshot = context.cluster.snapshot()
        reason = context.unavailable_reason
        body = {
            "status": "ok" if reason is None else "unavailable",
            "state": context.state.value,
            "num_live_engines": snapshot.num_live_engines,
            "num_expected_engines": snapshot.num_expected_engines,
            # Live engines by role, and those lost (id -> why): one lost of two DEs serves on,
            # degraded; no PE or no DE left is a 503.
            "num_live_engines_by_role": snapshot.num_live_engines_by_role,
            "dead_engines": {str(e): why for e, why in snapshot.dead_engines.items()},
            # Engines started again after they died (--restart-engines): id -> how often.
            "engine_restarts": {str(e): n for e, n in snapshot.engine_restarts.items()},
            # Times each engine was declared dead, wherever it ran (a remote engine that came
            # back at once is counted here, never in dead_engines): id -> how often.
            "engine_deaths": {str(e): n for e, n in snapshot.engine_deaths.items()},
            # Engines alive but in one step longer than the heartbeat timeout (their heartbeat
            # threads say so): id -> the step's time so far (s). Busy, not dead.
            "busy_engines": {str(e): round(s, 1) for e, s in snapshot.busy_engines.items()},
            # Store faults the engines met so far (cumulative): serving goes on regardless,
            # recomputing what it cannot read and not persisting what it cannot write.
            "store": {
                name: sum(c.get(f"store_{name}", 0) for c in snapshot.link_bytes.values())
                for name in _HEALTH_STORE_COUNTERS
            },
        }
        if reason is not None:
            body["reason"] = reason
        missing = context.missing_engines()
        if missing:  # by role: what a router started before its engines still waits for
            body["missing_engines_by_role"] = missing
        return JSONResponse(body, status_code=200 if reason is None else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(context.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}


def _lifespan(
    context: ServingContext,
    servers: VLLMServers,
    on_fatal: Callable[[], None],
    on_ready: Callable[[], None] | None,
) -> Callable[[FastAPI], AsyncIterator[None]]:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        context.loop = asyncio.get_running_loop()
        async with servers, anyio.create_task_group() as tasks:
            tasks.start_soon(_start_cluster, context, on_fatal, on_ready)
            tasks.start_soon(_sample_links, context)
            try:
                yield
            finally:
                context.stop_serving("the server is shutting down")
                # Makes a start-up still in progress give up, so _start_cluster returns.
                await anyio.to_thread.run_sync(context.cluster.close)
                tasks.cancel_scope.cancel()
        logger.info("cluster closed")

    return lifespan


async def _start_cluster(
    context: ServingContext,
    on_fatal: Callable[[], None],
    on_ready: Callable[[], None] | None,
) -> None:
    timeout_s = context.config.engine_start_timeout_s  # None: as long as it takes
    try:
        await anyio.to_thread.run_sync(lambda: context.cluster.start(timeout_s))
    except (RuntimeError, TimeoutError) as exc:
        if context.state == ServerState.STOPPING:
            return  # closed while starting: a signal arrived
        logger.error("the cluster did not start: %s", exc)
        context.state = ServerState.FAILED
        on_fatal()
        return
    if context.state == ServerState.STARTING:
        context.state = ServerState.READY
        snapshot = context.cluster.snapshot()
        logger.info("ready: %d engines joined", snapshot.num_live_engines)
        if on_ready is not None:
            on_ready()


async def _sample_links(context: ServingContext) -> None:
    """Feed link counters to the rate tracker once a second (utilisation over a window)."""
    while True:
        snapshot = context.cluster.snapshot()
        context.metrics.links.observe(snapshot.time_s, link_totals(snapshot.link_bytes))
        await anyio.sleep(_LINK_SAMPLE_INTERVAL_S)
