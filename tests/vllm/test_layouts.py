"""vLLM's page layouts as Layer Blocks, on caches vLLM itself allocates (``allocate_kv_cache``,
in every ``KVCacheLayout`` each backend supports), filled the way each backend writes them:
vLLM's own cache-write op where one runs on CPU (CPU attention, CPU and AMX MLA), else through
the view its kernel reads (``kv.transpose(1, 2).split(head_dim, -1)`` for FlashAttention and
Triton, the permuted NHD/HND view for FlashInfer, ``kv.squeeze(1)`` for MLA). Every value
encodes its layer, slot, head and channel, so a misplaced byte shows. float32 keeps each code
exact and distinct (AMX MLA, bfloat16 only, wraps its codes); the adapters move bytes, so the
dtype only scales C. No engine is started.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from dualpath.kv.layout import KVLayout

pytestmark = pytest.mark.vllm

NUM_LAYERS, NUM_BLOCKS, NUM_KV_HEADS, HEAD_DIM, MLA_HEAD = 2, 4, 2, 32, 576
BACKENDS = [
    "CPU_ATTN",
    "FLASH_ATTN",
    "TRITON_ATTN",
    "FLASHINFER",
    "CPU_MLA",
    "AMX_MLA",
    "FLASHMLA",
    "TRITON_MLA",
]
MLA = ("CPU_MLA", "AMX_MLA", "FLASHMLA", "TRITON_MLA")
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]


class Case:
    """One backend in one layout: vLLM's caches for it, and how its kernels address a slot."""

    def __init__(self, config: object, backend: str, layout: object) -> None:
        self.config, self.backend, self.layout = config, backend, layout
        self.spec = _spec(backend)
        self.block_size = self.spec.block_size
        self.num_heads = self.spec.num_heads
        self.content = self.spec.state_content_size_bytes // self.spec.dtype.itemsize
        bytes_per_token = self.num_heads * self.spec.state_content_size_bytes
        self.store = KVLayout(NUM_LAYERS, self.block_size, bytes_per_token)

    def caches(self) -> dict[str, torch.Tensor]:
        """Zeroed per-layer views, shaped and strided by vLLM's allocator for this layout."""
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups
        from vllm.v1.kv_cache_interface import KVCacheGroupSpec
        from vllm.v1.worker.utils import allocate_kv_cache

        self.config.cache_config.kv_cache_layout = self.layout.name
        group = KVCacheGroupSpec(NAMES, self.spec)
        memory = self.spec.page_size_bytes * NUM_LAYERS * NUM_BLOCKS
        config = get_kv_cache_config_from_groups(self.config, [group], memory)
        assert config.num_blocks == NUM_BLOCKS
        return allocate_kv_cache(config, torch.device("cpu"), self.layout)

    def codes(self, shift: int = 0) -> torch.Tensor:
        """``[layers, slots, H, C]``: each value names its position (``shift`` makes another)."""
        shape = (NUM_LAYERS, NUM_BLOCKS * self.block_size, self.num_heads, self.content)
        index = torch.arange(int(np.prod(shape)), dtype=torch.int64).view(shape) + shift
        if self.spec.dtype == torch.float32:
            return (index + 1).to(torch.float32)  # exact below 2**24
        # Finite, normal bfloat16 bit patterns 0x0400..0x73ff.
        return (index % 0x7000 + 0x0400).to(torch.int16).view(torch.bfloat16)

    @property
    def has_write_op(self) -> bool:
        return self.backend in ("CPU_ATTN", "CPU_MLA", "AMX_MLA")

    def write(self, kv: torch.Tensor, slots: torch.Tensor, codes: torch.Tensor) -> None:
        """``codes[i]`` (``[H, C]``) into slot ``slots[i]`` of one layer, as the backend does."""
        import vllm._custom_ops as ops

        if self.backend == "CPU_ATTN":
            from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

            isa = _get_attn_isa(kv.dtype, self.block_size, HEAD_DIM)
            halves = kv.view(kv.shape[0], self.num_heads, 2 * self.block_size, HEAD_DIM)
            key_cache, value_cache = halves.chunk(2, dim=2)  # CPUAttentionBackendImpl's split
            key, value = codes.split(HEAD_DIM, dim=-1)
            ops.cpu_attn_reshape_and_cache(
                key.contiguous(), value.contiguous(), key_cache, value_cache, slots, isa
            )
        elif self.backend == "CPU_MLA":
            from vllm.v1.attention.backends.mla.cpu_mla import CPUMLAImpl

            latent, rope = codes[:, :, :512], codes[:, :, 512:]
            # The method uses no state of the impl.
            CPUMLAImpl.do_kv_cache_update(
                None, latent[:, 0], rope, kv.squeeze(1), slots, "auto", None
            )
        elif self.backend == "AMX_MLA":
            latent, rope = codes[:, 0, :512].contiguous(), codes[:, 0, 512:].contiguous()
            ops.amx_mla_concat_and_cache(latent, rope, kv.squeeze(1), slots)
        else:
            view = self.kernel_view(kv)
            view[slots // self.block_size, slots % self.block_size] = codes

    def kernel_view(self, kv: torch.Tensor) -> torch.Tensor:
        """``[blocks, block_size, H, C]``: where the backend's kernels read each slot."""
        if self.backend in MLA:
            return kv.squeeze(1).unsqueeze(2)  # FlashMLA's k_cache, Triton MLA's view
        if self.backend == "FLASHINFER":
            from vllm.v1.attention.backends.utils import get_flashinfer_layout_string

            permuted = kv.permute(*self.layout.layer_view_order)  # FlashInferImpl.forward
            nhd = get_flashinfer_layout_string(self.layout) == "NHD"
            return permuted if nhd else permuted.transpose(1, 2)
        return kv.transpose(1, 2)  # FlashAttention and Triton: key, value = split(head_dim)

    def read_slots(self, caches: dict[str, torch.Tensor], layer: int) -> torch.Tensor:
        """``[slots, H, C]`` of one layer, read where the kernels read them."""
        view = self.kernel_view(caches[NAMES[layer]])
        return view.reshape(-1, self.num_heads, self.content)

    def fill(self, caches: dict[str, torch.Tensor], codes: torch.Tensor) -> None:
        slots = torch.arange(codes.shape[1])
        for layer, name in enumerate(NAMES):
            self.write(caches[name], slots, codes[layer])


def _spec(backend: str):  # noqa: ANN202
    """The backend's attention spec (``customize_spec``), at its first kernel block size."""
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MLAAttentionSpec
    from vllm.v1.worker.utils import customize_attention_spec

    # FlashInfer's class needs the flashinfer package; 16 is among its block sizes.
    cls = None if backend == "FLASHINFER" else AttentionBackendEnum[backend].get_class()
    size = cls.get_supported_kernel_block_sizes()[0] if cls is not None else 16
    block_size = size if isinstance(size, int) else size.base
    if backend in MLA:
        dtype = torch.bfloat16 if backend == "AMX_MLA" else torch.float32  # AMX: bf16 only
        spec = MLAAttentionSpec(
            block_size=block_size, num_kv_heads=1, head_size=MLA_HEAD, dtype=dtype
        )
    else:
        spec = FullAttentionSpec(
            block_size=block_size,
            num_kv_heads=NUM_KV_HEADS,
            head_size=HEAD_DIM,
            dtype=torch.float32,
        )
    return spec if cls is None else customize_attention_spec(cls, spec)


def _layouts(backend: str) -> list:
    """The layouts vLLM lets ``backend`` run on (its ``supported_kv_cache_layouts``)."""
    from vllm.v1.attention.backends.utils import get_supported_kv_cache_layouts
    from vllm.v1.kv_cache_layout import KVCacheLayout

    if backend == "FLASHINFER":  # its class needs the flashinfer package: its layout names
        from vllm.v1.attention.backends.utils import _FLASHINFER_LAYOUT_NAMES

        return [layout for layout in KVCacheLayout if layout.name in _FLASHINFER_LAYOUT_NAMES]
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    layouts = get_supported_kv_cache_layouts([AttentionBackendEnum[backend].get_class()])
    assert backend != "CPU_ATTN" or [layout.name for layout in layouts] == ["LBHNC"]
    return layouts


@pytest.fixture(scope="module")
def vllm_config() -> object:
    from vllm.config import VllmConfig

    return VllmConfig()


def _has_kernel_op(name: str) -> bool:
    """Whether the vLLM kernels loaded on this host have op ``name``: which ops a CPU build
    has depends on the host's vector ISA (an AVX2 host's kernels have no AMX MLA)."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's kernels into torch.ops._C)

    return hasattr(torch.ops._C, name)


@pytest.fixture(params=BACKENDS)
def cases(request: pytest.FixtureRequest, vllm_config: object) -> list[Case]:
    if request.param == "AMX_MLA" and not _has_kernel_op("concat_and_cache_mla_cpu"):
        pytest.skip(
            "AMX_MLA's cache-write op (concat_and_cache_mla_cpu) is not in the vLLM kernels "
            "this host's CPU loads, so its layout cannot be checked against it here"
        )
    cases = [Case(vllm_config, request.param, layout) for layout in _layouts(request.param)]
    if request.param in ("CPU_MLA", "AMX_MLA"):
        # Their cache-write op and decode kernel view a layer as [slots, C]: a layer must be
        # one run, so block-outer layouts never run with them.
        cases = [case for case in cases if case.caches()[NAMES[0]].is_contiguous()]
    assert cases
    return cases


def _decode(case: Case, order: str, blocks: np.ndarray) -> torch.Tensor:
    """Layer Blocks read as ``order`` says: ``[n, block_size, H, C]``."""
    from dualpath.model.identity import (
        VLLM_CPU_PAGE_ORDER,
        VLLM_HND_ORDER,
        VLLM_MLA_ORDER,
        VLLM_NHD_ORDER,
    )
    from dualpath.vllm.cache import page_entries

    n, tokens, heads, content = len(blocks), case.block_size, case.num_heads, case.content
    values = torch.from_numpy(blocks.copy()).view(case.spec.dtype)
    if order in (VLLM_NHD_ORDER, VLLM_MLA_ORDER):
        return values.reshape(n, tokens, heads, content)
    if order == VLLM_HND_ORDER:
        return values.reshape(n, heads, tokens, content).transpose(1, 2)
    assert order == VLLM_CPU_PAGE_ORDER, order
    pages = values.reshape(n, heads, tokens, content)
    entries = [page_entries(pages, i).transpose(1, 2) for i in range(n)]  # [bs, H, 2, D]
    return torch.stack(entries).reshape(n, tokens, heads, content)


def _read_all(pages, case: Case, layer: int, block_ids: list[int]) -> np.ndarray:  # noqa: ANN001
    out = np.empty((len(block_ids), *case.store.layer_block_shape), np.uint8)
    pages.read_layer(layer, block_ids, out)
    return out


def _expect_slots(case: Case, caches: dict, expected: Callable[[int], torch.Tensor]) -> None:
    for layer in range(NUM_LAYERS):
        got = case.read_slots(caches, layer)
        assert torch.equal(got, expected(layer)), f"{case.backend} {case.layout.name} {layer}"


def test_whole_blocks_round_trip_bit_exact_into_the_kernels_slots(cases: list[Case]) -> None:
    from dualpath.model.identity import VLLM_CPU_PAGE_ORDER
    from dualpath.vllm.layouts import choose_layout

    for case in cases:
        where = f"{case.backend} {case.layout.name}"
        codes = case.codes()
        source = case.caches()
        case.fill(source, codes)
        pages = choose_layout(source, case.backend, case.store)
        assert pages.backend == case.backend
        block_ids = [3, 0, 2, 1]
        blocks = [_read_all(pages, case, layer, block_ids) for layer in range(NUM_LAYERS)]
        # The order string says what the bytes are: each block's codes, token by token.
        for layer in range(NUM_LAYERS):
            expected = codes[layer].view(NUM_BLOCKS, case.block_size, case.num_heads, -1)
            decoded = _decode(case, pages.order, blocks[layer])
            assert torch.equal(decoded, expected[block_ids]), where
        # A Full Block is the Layer Blocks, layer 0 first.
        full_block = pages.copy_full_block(block_ids[0])
        assert all(np.array_equal(full_block[i], blocks[i][0]) for i in range(NUM_LAYERS))

        target = case.caches()
        target_pages = choose_layout(target, case.backend, case.store)
        for layer in range(NUM_LAYERS):
            target_pages.write_layer(layer, block_ids, blocks[layer])
            target_pages.fence(layer)
        for name in NAMES:
            assert torch.equal(target[name], source[name]), where
        for layer in range(NUM_LAYERS):
            assert np.array_equal(_read_all(target_pages, case, layer, block_ids), blocks[layer])
        if case.backend != "CPU_ATTN":  # its kernel's view is its packing: equal pages above
            _expect_slots(case, target, codes.__getitem__)
        else:
            assert pages.order == VLLM_CPU_PAGE_ORDER


def test_token_ranges_land_at_their_slots_and_keep_the_other_tokens(cases: list[Case]) -> None:
    from dualpath.vllm.layouts import choose_layout

    for case in cases:
        where = f"{case.backend} {case.layout.name}"
        old, new = case.codes(shift=0), case.codes(shift=777)
        source = case.caches()
        case.fill(source, new)
        block_ids = [2, 1]
        blocks = [
            _read_all(choose_layout(source, case.backend, case.store), case, layer, block_ids)
            for layer in range(NUM_LAYERS)
        ]
        first, num = 3, 5
        target = case.caches()
        case.fill(target, old)
        pages = choose_layout(target, case.backend, case.store)
        for layer in range(NUM_LAYERS):
            pages.write_layer(layer, block_ids, blocks[layer], first, num)
            pages.fence(layer)

        # vLLM's own writes: old everywhere, then new at exactly those slots.
        slots = torch.tensor(
            [b * case.block_size + t for b in block_ids for t in range(first, first + num)]
        )
        expected = case.caches()
        case.fill(expected, old)
        for layer, name in enumerate(NAMES):
            case.write(expected[name], slots, new[layer][slots])
        for name in NAMES:
            assert torch.equal(target[name], expected[name]), where

        # Two ranges that cover the blocks write what one whole write does.
        halves = case.caches()
        halves_pages = choose_layout(halves, case.backend, case.store)
        for layer in range(NUM_LAYERS):
            halves_pages.write_layer(layer, block_ids, blocks[layer], 0, first)
            halves_pages.write_layer(layer, block_ids, blocks[layer], first)
        for layer in range(NUM_LAYERS):
            pages_bytes = _read_all(halves_pages, case, layer, block_ids)
            assert np.array_equal(pages_bytes, blocks[layer]), where
            untouched = [b for b in range(NUM_BLOCKS) if b not in block_ids]
            assert not _read_all(halves_pages, case, layer, untouched).any(), where


def test_a_layer_view_is_the_pages_themselves_where_they_are_one_run(cases: list[Case]) -> None:
    from dualpath.vllm.layouts import choose_layout

    for case in cases:
        where = f"{case.backend} {case.layout.name}"
        caches = case.caches()
        case.fill(caches, case.codes())
        pages = choose_layout(caches, case.backend, case.store)
        # vLLM's word for "a block is one run" and "a layer's blocks follow each other";
        # with one head, where the head dim sits does not matter.
        is_block_run = case.layout.is_block_compact or case.num_heads == 1
        is_layer_run = is_block_run and case.layout.is_layer_compact
        assert pages.layer_view(0, [1, 3]) is None, where
        for block_ids, expected in (([2], is_block_run), ([1, 2], is_layer_run)):
            view = pages.layer_view(1, block_ids)
            assert (view is not None) == expected, f"{where} {block_ids}"
            if view is None:
                continue
            assert np.array_equal(view, _read_all(pages, case, 1, block_ids)), where
            view[-1, -1, -1] ^= 0xFF  # writes go straight into vLLM's pages
            assert np.array_equal(view, _read_all(pages, case, 1, block_ids)), where


def test_choose_layout_refuses_what_it_cannot_map(vllm_config: object) -> None:
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from dualpath.vllm.layouts import choose_layout

    dense = Case(vllm_config, "FLASH_ATTN", KVCacheLayout.LBNHC)
    caches = dense.caches()
    with pytest.raises(ValueError, match=r"'FLEX_ATTENTION'.*shape \(4, 2, 16, 64\), stride"):
        choose_layout(caches, "FLEX_ATTENTION", dense.store)
    with pytest.raises(ValueError, match=r"'FLASHMLA'.*H = 1"):
        choose_layout(caches, "FLASHMLA", dense.store)
    with pytest.raises(ValueError, match=r"'CPU_ATTN'.*LBHNC"):  # NHD pages, not the CPU's
        choose_layout(caches, "CPU_ATTN", dense.store)
    other_block = KVLayout(NUM_LAYERS, 32, dense.store.bytes_per_token_per_layer)
    with pytest.raises(ValueError, match="16-token blocks"):
        choose_layout(caches, "FLASH_ATTN", other_block)


def test_every_page_order_has_its_own_name() -> None:
    from dualpath.model.identity import (
        VLLM_CPU_PAGE_ORDER,
        VLLM_HND_ORDER,
        VLLM_MLA_ORDER,
        VLLM_NHD_ORDER,
    )

    orders = [VLLM_CPU_PAGE_ORDER, VLLM_HND_ORDER, VLLM_MLA_ORDER, VLLM_NHD_ORDER]
    assert len(set(orders)) == len(orders)


def test_the_cuda_copier_has_the_host_copiers_calls() -> None:
    from dualpath.engine.pages import CudaCopier, HostCopier

    for name in ("write", "read", "fence"):
        assert callable(getattr(CudaCopier, name)) and callable(getattr(HostCopier, name))


@pytest.mark.gpu
def test_device_pages_load_on_a_side_stream_and_fence_per_layer() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from dualpath.engine.pages import CudaCopier
    from dualpath.vllm.layouts import StridedPages

    layout = KVLayout(NUM_LAYERS, 16, NUM_KV_HEADS * 2 * HEAD_DIM * 2)
    device = torch.device("cuda")
    shape = (NUM_BLOCKS, NUM_KV_HEADS, 16, 2 * HEAD_DIM)
    layers = [torch.zeros(shape, dtype=torch.float16, device=device) for _ in NAMES]
    pages = StridedPages(layers, layout, CudaCopier(device, NUM_LAYERS), "FLASH_ATTN")
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (2, *layout.layer_block_shape), dtype=np.uint8)
    for layer in range(NUM_LAYERS):
        pages.write_layer(layer, [3, 1], blocks)
        pages.fence(layer)
    out = np.empty_like(blocks)
    pages.read_layer(1, [3, 1], out)
    assert np.array_equal(out, blocks)
