"""What names a checkpoint's KV in the store, computed without torch.

The scheduler process needs the store namespace and the block layout to look prompts up, and
must not load the model to get them; engines compute the same values from the same files.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from dualpath.errors import CheckpointError
from dualpath.kv.hashing import digest_files, model_fingerprint
from dualpath.kv.layout import KVLayout
from dualpath.model.registry import AnyModelConfig, read_config

DTYPE_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}

# The byte order of a vLLM engine's Layer Block: vLLM's CPU attention page, per KV head K
# [head_dim][block_size] (dim-major) then V [block_size][head_dim] (token-major). The native
# engine's Layer Block is token-major, [block_size][2][kv_heads][head_dim].
VLLM_CPU_PAGE_ORDER = (
    "vllm-cpu-page: per kv head, K [head_dim][block_size], V [block_size][head_dim]"
)
# vLLM's other pages (``dualpath.vllm.layouts``): one name per byte order, never shared.
VLLM_NHD_ORDER = "vllm-page-nhd: per token, per kv head, K [head_dim] then V [head_dim]"
VLLM_HND_ORDER = "vllm-page-hnd: per kv head, per token, K [head_dim] then V [head_dim]"
VLLM_MLA_ORDER = "vllm-page-mla: per token, latent [kv_lora_rank] then rope [qk_rope_head_dim]"


def vllm_device() -> str:
    """Where this host's vLLM engines run: "cuda" with a GPU (vLLM's CUDA build), else "cpu"
    (its CPU build). vLLM's platform is the build's, never a flag of ours."""
    import torch  # only a vLLM engine's identity asks: it runs torch anyway

    return "cuda" if torch.cuda.is_available() else "cpu"


def vllm_page_order(config: AnyModelConfig, device: str = "cpu") -> str:
    """The byte order of a vLLM engine's Layer Blocks for ``config`` on ``device``: MLA pages
    (one latent + rope entry a token) anywhere; a dense model's CPU attention page on a CPU,
    token-major (vLLM's default layout) on a GPU. The store's fingerprint names it, and the
    engine refuses to start if the pages vLLM registers are in another."""
    if "latent" in dict(config.cache_entry_parts()):
        return VLLM_MLA_ORDER
    return VLLM_CPU_PAGE_ORDER if device == "cpu" else VLLM_NHD_ORDER


def weight_files(path: Path) -> list[Path]:
    """The checkpoint's ``*.safetensors`` files in name order; ``CheckpointError`` if none."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weight files")
    return files


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """The store namespace (``fingerprint``) and Full Block layout of one served model."""

    fingerprint: str
    layout: KVLayout
    kv_dtype: str


def kv_layout(config: AnyModelConfig, kv_dtype: str, block_size_tokens: int) -> KVLayout:
    """The Full Block layout of ``config``'s KV in ``kv_dtype`` (no weights read)."""
    if kv_dtype not in DTYPE_ITEMSIZE:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_ITEMSIZE)}, got {kv_dtype!r}")
    return KVLayout(
        num_layers=config.num_layers,
        block_size_tokens=block_size_tokens,
        bytes_per_token_per_layer=config.kv_bytes_per_token_per_layer(DTYPE_ITEMSIZE[kv_dtype]),
    )


def kv_identity(
    config: AnyModelConfig,
    weights_digest: str,
    kv_dtype: str,
    block_size_tokens: int,
    engine: str = "native",
    device: str = "cpu",
) -> KVIdentity:
    """``engine``: what computes the KV ("native" or "vllm"), on ``device``. Two engine kinds'
    kernels do not give bit-identical KV, and a vLLM engine's blocks hold its pages as they are
    (``vllm_page_order``), so the kinds' blocks live in different namespaces (SPEC §9); the
    native engine's namespace is the one every store written before engines had kinds uses."""
    layout = kv_layout(config, kv_dtype, block_size_tokens)
    architecture = config.architecture_dict()
    if engine == "vllm":
        order = vllm_page_order(config, device)
        architecture = {**architecture, "kv_engine": engine, "kv_order": order}
    elif engine != "native":
        raise ValueError(f"engine must be 'native' or 'vllm', got {engine!r}")
    fingerprint = model_fingerprint(
        weights_digest=weights_digest,
        architecture=architecture,
        kv_dtype=kv_dtype,
        block_size_tokens=block_size_tokens,
    )
    return KVIdentity(fingerprint, layout, kv_dtype)


def kv_facts(config: AnyModelConfig, kv_dtype: str | None = None) -> dict:
    """What one token's KV is and costs, for result files: its entry's parts, its bytes per
    layer and in all layers, in ``kv_dtype`` (default: the checkpoint's)."""
    kv_dtype = kv_dtype or config.torch_dtype
    per_layer = config.kv_bytes_per_token_per_layer(DTYPE_ITEMSIZE[kv_dtype])
    return {
        "architecture": config.architecture,
        "num_layers": config.num_layers,
        "kv_dtype": kv_dtype,
        "cache_entry": dict(config.cache_entry_parts()),
        "kv_bytes_per_token_per_layer": per_layer,
        "kv_bytes_per_token": per_layer * config.num_layers,
    }


def checkpoint_kv_identity(
    path: Path,
    kv_dtype: str | None,
    block_size_tokens: int,
    engine: str = "native",
    device: str = "cpu",
) -> tuple[AnyModelConfig, KVIdentity]:
    """Read a checkpoint directory's config and weights digest (no torch, no weights loaded)."""
    config = read_config(Path(path) / "config.json")
    digest = digest_files(weight_files(Path(path)))
    return config, kv_identity(
        config, digest, kv_dtype or config.torch_dtype, block_size_tokens, engine, device
    )
