"""``ServerConfig``: the HTTP side of ``dualpath serve`` (the cluster has its own configs)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

GENERATION_CONFIG_MODES = ("auto", "none")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """Where the API listens and what it admits. Frozen and inert; ``cli.py`` builds it."""

    served_model_name: str  # the only id /v1/models lists and requests may name
    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    # Bearer token required on /v1/*, /tokenize and /detokenize; None = open.
    api_key: str | None = None
    # Generations accepted but without a first token yet; one more is answered with 429.
    # A generation is one prompt x one choice, so n=4 takes 4 places.
    max_waiting_requests: int = 512
    # Request bodies beyond this are refused with 413 before they are parsed.
    max_request_bytes: int = 8 << 20
    # Prompt tokens per prompt; None = the model's context minus one (room for a token).
    max_prompt_tokens: int | None = None
    # n (choices per prompt) x prompts per request.
    max_num_generations_per_request: int = 64
    # How long start-up may wait for every engine to join; None: as long as it takes (a
    # router in front of servers others start, which may load a checkpoint for many minutes).
    engine_start_timeout_s: float | None = 300.0
    # On SIGINT/SIGTERM, open connections get this long to finish after their requests are
    # cancelled, before uvicorn closes them.
    shutdown_timeout_s: float = 10.0
    # Link throughput and utilisation in /metrics are averaged over this window.
    metrics_window_s: float = 10.0
    # "auto": requests that omit temperature, top_p, top_k (or, in chat, max_tokens) get the
    # checkpoint's generation_config.json values, as in vLLM; "none": ours (OpenAI's).
    generation_config: str = "auto"
    # Where POST /v1/responses keeps its responses (``response_store.py``): a directory, or
    # None to keep them in memory only (lost on exit; ``cli.py`` gives serve a directory).
    responses_dir: Path | None = None
    # Kept responses beyond either bound evict the oldest. Each keeps its whole conversation,
    # so an agent session of many turns weighs more than its last turn.
    responses_max_count: int = 10_000
    responses_max_bytes: int = 1 << 30

    def __post_init__(self) -> None:
        if not self.served_model_name:
            raise ValueError("served_model_name must be non-empty")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty (or None for no key)")
        for name in (
            "max_waiting_requests",
            "max_request_bytes",
            "max_num_generations_per_request",
            "responses_max_count",
            "responses_max_bytes",
        ):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.max_prompt_tokens is not None and self.max_prompt_tokens <= 0:
            raise ValueError(f"max_prompt_tokens must be > 0 or None, got {self.max_prompt_tokens}")
        if self.generation_config not in GENERATION_CONFIG_MODES:
            raise ValueError(
                f"generation_config must be one of {', '.join(GENERATION_CONFIG_MODES)}, "
                f"got {self.generation_config!r}"
            )
        if self.engine_start_timeout_s is not None and not self.engine_start_timeout_s > 0:
            raise ValueError(
                f"engine_start_timeout_s must be > 0 or None, got {self.engine_start_timeout_s}"
            )
        for name in ("shutdown_timeout_s", "metrics_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
