"""DeepSeek-V3 / V3.2 (dualpath.model.deepseek, deepseek_config) against transformers 5.24, on
tiny random checkpoints that transformers builds and writes itself (``save_pretrained``: its
config.json spelling and its per-expert weight names), in float32.

Tolerances: our logits vs transformers' within atol 1e-4 / rtol 1e-4. Logits reach ~70 here;
the largest differences seen are ~2e-5 (naive attention, transformers' own computation) and
~1e-4 (absorbed: other sums, same math). Our paths against each other (chunked, packed,
absorbed vs naive) within atol 1e-4 / rtol 1e-5.
"""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dualpath.errors import CheckpointError
from dualpath.model.deepseek import DeepseekDecoderModel
from dualpath.model.deepseek_config import DeepseekConfig, cache_entry_spec
from dualpath.model.deepseek_moe import stack_expert_weights
from dualpath.model.layerwise import PackedBatch, PaddedPast
from tests.model.published import PUBLISHED_V3, PUBLISHED_V32, dequantized
from tests.model.weights import randomize_weights

transformers = pytest.importorskip("transformers", minversion="5.24")
from transformers.initialization import no_init_weights  # noqa: E402

NUM_GENERATED_TOKENS = 8
INDEX_TOPK = 8
PROMPT_A = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(1))  # > INDEX_TOPK
PROMPT_B = torch.randint(0, 256, (17,), generator=torch.Generator().manual_seed(2))

# Small, with every feature on: dense layer 0 then MoE (8 experts in 4 groups, 2 groups kept,
# 3 experts per token, a shared expert), low-rank q and kv.
_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=3,
    n_group=4,
    topk_group=2,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    max_position_embeddings=512,
    eos_token_id=None,  # greedy decoding must not stop early
)
_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.8,  # != mscale: cos/sin and the softmax scale both change
}
CASES: dict[str, Callable[[], object]] = {
    "v3-yarn": lambda: transformers.DeepseekV3Config(**_SHAPE, rope_parameters=_YARN),
    "v3-no-q-lora": lambda: transformers.DeepseekV3Config(
        **{**_SHAPE, "q_lora_rank": None}, rope_interleave=False, attention_bias=True
    ),
    "v32": lambda: transformers.DeepseekV32Config(
        **_SHAPE, index_topk=INDEX_TOPK, index_n_heads=8, index_head_dim=16
    ),
}


@dataclasses.dataclass
class Case:
    reference: torch.nn.Module  # transformers' model
    ours: DeepseekDecoderModel
    prompt_logits: torch.Tensor  # transformers' logits of PROMPT_A, every row
    generated: list[list[int]]  # transformers' greedy tokens after PROMPT_A, PROMPT_B


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    torch.manual_seed(0)
    with no_init_weights():  # every weight is drawn below
        reference = transformers.AutoModelForCausalLM.from_config(
            CASES[request.param](), dtype=torch.float32
        ).eval()
    _randomize(reference)
    path = tmp_path_factory.mktemp(request.param)
    reference.save_pretrained(path)

    config = DeepseekConfig.from_dict(json.loads((path / "config.json").read_text()))
    ours = DeepseekDecoderModel(config)
    ours.load_state_dict(stack_expert_weights(load_file(path / "model.safetensors")), strict=True)
    ours.eval()
    with torch.no_grad():
        prompt_logits = reference(PROMPT_A[None]).logits[0]
        generated = [
            reference.generate(p[None], max_new_tokens=NUM_GENERATED_TOKENS, do_sample=False)[
                0, len(p) :
            ].tolist()
            for p in (PROMPT_A, PROMPT_B)
        ]
    return Case(reference, ours, prompt_logits, generated)


def _randomize(model: torch.nn.Module) -> None:
    """Weights large enough that attention, routing and the indexer's top-k are far from uniform,
    and a final norm near 10 so logits spread and greedy picks win by wide margins."""
    randomize_weights(model)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # transformers inits it to zeros
                buffer.normal_(0.0, 0.1)


def _padded(cached: list[torch.Tensor]) -> PaddedPast:
    """Per-sequence entries ``[c_i, *shape]`` copied into one decode step's padded tensor
    (each sequence's filler repeats its token 0)."""
    width = max(c.shape[0] for c in cached) + 1
    first = cached[0]
    entries = first.new_empty(len(cached), width, *first.shape[1:])
    for i, c in enumerate(cached):
        entries[i, : c.shape[0]] = c
        entries[i, c.shape[0] :] = c[:1]
    return PaddedPast(entries)


def _prefill(
    model: DeepseekDecoderModel, ids: torch.Tensor, num_cached: int = 0, past: list | None = None
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    batch = PackedBatch((num_cached,), (len(ids),))
    return model.forward_full(ids, batch, past or model.empty_past(1))


def _greedy(model: DeepseekDecoderModel, prompts: list[torch.Tensor]) -> list[list[int]]:
    """Prefill the prompts packed in one batch, then decode from the entries with
    ``PaddedPast``, one token per sequence per step."""
    lengths = tuple(len(p) for p in prompts)
    batch = PackedBatch((0,) * len(prompts), lengths)
    logits, new = model.forward_full(torch.cat(prompts), batch, model.empty_past(len(prompts)))
    offsets = batch.row_offsets
    caches = [[e[offsets[i] : offsets[i + 1]] for i in range(len(prompts))] for e in new]
    tokens = [[int(logits[row].argmax())] for row in batch.last_rows()]
    while len(tokens[0]) < NUM_GENERATED_TOKENS:
        batch = PackedBatch(tuple(c.shape[0] for c in caches[0]), (1,) * len(prompts))
        past = [_padded(layer) for layer in caches]
        logits, new = model.forward_full(torch.tensor([t[-1] for t in tokens]), batch, past)
        for layer, entries in enumerate(new):
            slots = past[layer].entries[range(len(prompts)), list(batch.num_cached_tokens)]
            assert torch.equal(slots, entries), "the new entries are written into their slots"
            caches[layer] = [
                torch.cat([c, entries[i : i + 1]]) for i, c in enumerate(caches[layer])
            ]
        for i, seq_tokens in enumerate(tokens):
            seq_tokens.append(int(logits[i].argmax()))
    return tokens


def test_parameter_names_are_transformers_state_dict_names(case: Case) -> None:
    assert set(case.ours.state_dict()) == set(case.reference.state_dict())


@pytest.mark.parametrize("absorb", [False, True], ids=["naive", "absorbed"])
def test_prompt_logits_match_transformers(case: Case, absorb: bool) -> None:
    case.ours.absorb = absorb
    logits, entries = _prefill(case.ours, PROMPT_A)
    torch.testing.assert_close(logits, case.prompt_logits, atol=1e-4, rtol=1e-4)
    assert [e.shape for e in entries] == [(len(PROMPT_A), case.ours.cache_entry_spec.dim)] * 3


@pytest.mark.parametrize("absorb", [False, True], ids=["naive", "absorbed"])
def test_greedy_decode_from_entries_matches_transformers_generate(case: Case, absorb: bool) -> None:
    case.ours.absorb = absorb
    assert _greedy(case.ours, [PROMPT_A, PROMPT_B]) == case.generated


def test_chunked_and_packed_prefill_match_whole_prompt(case: Case) -> None:
    model = case.ours
    model.absorb = True
    whole_logits, whole_entries = _prefill(model, PROMPT_A)

    cached = [torch.empty(0, model.cache_entry_spec.dim)] * model.num_layers
    chunk_logits = []
    for start, end in ((0, 10), (10, 18), (18, 24)):
        logits, new = _prefill(model, PROMPT_A[start:end], start, [[c] for c in cached])
        chunk_logits.append(logits)
        cached = [torch.cat([c, n]) for c, n in zip(cached, new, strict=True)]
    _assert_same(torch.cat(chunk_logits), whole_logits)
    for c, w in zip(cached, whole_entries, strict=True):
        _assert_same(c, w)

    # B whole and A's last 14 tokens over its 10 cached ones, packed in one batch.
    batch = PackedBatch((0, 10), (len(PROMPT_B), 14))
    past = [[torch.empty(0, w.shape[1]), w[:10]] for w in whole_entries]
    logits, new = model.forward_full(torch.cat([PROMPT_B, PROMPT_A[10:]]), batch, past)
    _assert_same(logits[len(PROMPT_B) :], whole_logits[10:])
    b_logits, b_entries = _prefill(model, PROMPT_B)
    _assert_same(logits[: len(PROMPT_B)], b_logits)
    for n, a, b in zip(new, whole_entries, b_entries, strict=True):
        _assert_same(n, torch.cat([b, a[10:]]))


def test_absorbed_decode_step_equals_naive(case: Case) -> None:
    model = case.ours
    _, a_entries = _prefill(model, PROMPT_A)
    _, b_entries = _prefill(model, PROMPT_B)
    batch = PackedBatch((len(PROMPT_A), len(PROMPT_B)), (1, 1))
    results = []
    for absorb in (False, True):
        model.absorb = absorb
        past = [_padded([a, b]) for a, b in zip(a_entries, b_entries, strict=True)]
        results.append(model.forward_full(torch.tensor([3, 5]), batch, past))
    (naive_logits, naive_new), (absorbed_logits, absorbed_new) = results
    _assert_same(absorbed_logits, naive_logits)
    for n, a in zip(naive_new, absorbed_new, strict=True):
        _assert_same(a, n)


@pytest.mark.parametrize("case", ["v32"], indirect=True)
def test_v32_indexer_attends_to_a_strict_subset(case: Case) -> None:
    """The prompt is longer than index_topk, so later queries see only some keys; attending to
    all of them instead gives other logits (and ours matched transformers' sparse ones above)."""
    config = case.ours.config
    assert config.indexer is not None
    assert len(PROMPT_A) > config.indexer.topk == INDEX_TOPK
    dense_config = dataclasses.replace(
        config, indexer=dataclasses.replace(config.indexer, topk=10_000)
    )
    dense = DeepseekDecoderModel(dense_config)
    dense.load_state_dict(case.ours.state_dict())
    dense_logits, _ = _prefill(dense, PROMPT_A)
    # The first INDEX_TOPK queries see at most INDEX_TOPK keys: nothing is dropped yet.
    _assert_same(dense_logits[:INDEX_TOPK], case.prompt_logits[:INDEX_TOPK])
    assert (dense_logits[INDEX_TOPK:] - case.prompt_logits[INDEX_TOPK:]).abs().max() > 1.0


def _assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-5)


def test_published_configs_parse_and_give_the_entry_dim() -> None:
    v3 = DeepseekConfig.from_dict(dequantized(PUBLISHED_V3))
    v32 = DeepseekConfig.from_dict(dequantized(PUBLISHED_V32))
    assert cache_entry_spec(v3).dim == 512 + 64
    assert cache_entry_spec(v32).dim == 512 + 64 + 128
    assert cache_entry_spec(v32).parts == (("latent", 512), ("rope_key", 64), ("index_key", 128))
    assert v3.kv_bytes_per_token_per_layer(2) == 1152  # bfloat16
    assert v32.kv_bytes_per_token_per_layer(2) == 1408
    assert v3.mlp_layer_types == ("dense",) * 3 + ("sparse",) * 58
    # YaRN: factor 40 with mscale == mscale_all_dim leaves cos/sin as they are and scales the
    # softmax by mscale(40) ** 2.
    assert v3.rope.attention_factor == 1.0
    assert v3.softmax_scale == pytest.approx(192**-0.5 * (0.1 * math.log(40) + 1) ** 2)


def test_from_file_adds_generation_config_eos_ids_like_model_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(dequantized(PUBLISHED_V3)))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1]}))
    config = DeepseekConfig.from_file(tmp_path / "config.json")
    assert config.eos_token_ids == (1, 7)
    assert config == dataclasses.replace(
        DeepseekConfig.from_dict(dequantized(PUBLISHED_V3)), eos_token_ids=(1, 7)
    )


def test_architecture_dict_is_json_and_holds_only_what_changes_the_kv() -> None:
    v3 = DeepseekConfig.from_dict(dequantized(PUBLISHED_V3))
    fields = json.loads(json.dumps(v3.architecture_dict()))
    assert fields["rope"]["rope_type"] == "yarn" and fields["indexer"] is None
    assert {"eos_token_ids", "bos_token_id", "torch_dtype"}.isdisjoint(fields)
    other = _with(PUBLISHED_V3, eos_token_id=[1, 2], torch_dtype="float32")
    assert DeepseekConfig.from_dict(other).architecture_dict() == v3.architecture_dict()
    wider = DeepseekConfig.from_dict(_with(PUBLISHED_V3, kv_lora_rank=256))
    assert wider.architecture_dict() != v3.architecture_dict()


def test_config_module_does_not_import_torch() -> None:
    """The scheduler process sizes KV from a DeepseekConfig without torch."""
    code = (
        "import sys, dualpath.model.deepseek_config; sys.exit(3 if 'torch' in sys.modules else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def _with(base: dict, **changes: object) -> dict:
    return {**dequantized(base), **changes}


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (PUBLISHED_V3, "quantization_config"),
        (PUBLISHED_V32, "quantization_config"),
        (_with(PUBLISHED_V3, scoring_func="softmax"), "scoring_func"),
        (_with(PUBLISHED_V3, topk_method="group_limited_greedy"), "topk_method"),
        (_with(PUBLISHED_V3, moe_layer_freq=2), "moe_layer_freq"),
        (_with(PUBLISHED_V3, hidden_act="gelu"), "hidden_act"),
        (_with(PUBLISHED_V3, mlp_bias=True), "mlp_bias"),
        (_with(PUBLISHED_V3, num_key_value_heads=16), "num_key_value_heads"),
        (_with(PUBLISHED_V3, rope_scaling={"type": "linear", "factor": 2.0}), "rope_type"),
        (_with(PUBLISHED_V3, rope_scaling={"type": "dynamic", "factor": 2.0}), "rope_type"),
        (_with(PUBLISHED_V32, q_lora_rank=None), "q_lora_rank"),
        (_with(PUBLISHED_V32, rope_interleave=False), "rope_interleave"),
        (_with(PUBLISHED_V32, layer_types=["full_attention"] * 61), r"layer_types\[0\]"),
        (_with(PUBLISHED_V3, architectures=["DeepseekV2ForCausalLM"]), "architecture"),
    ],
)
def test_config_refuses_what_is_not_implemented_by_name(raw: dict, field: str) -> None:
    with pytest.raises(CheckpointError, match=field):
        DeepseekConfig.from_dict(raw)


def test_expert_weights_of_a_checkpoint_must_be_complete() -> None:
    state = {
        f"model.layers.1.mlp.experts.{e}.{proj}.weight": torch.zeros(2, 2)
        for e in (0, 2)
        for proj in ("gate_proj", "up_proj", "down_proj")
    }
    with pytest.raises(CheckpointError, match="experts 0..1"):
        stack_expert_weights(state)
