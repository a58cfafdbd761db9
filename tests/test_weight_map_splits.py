"""The weight map describes transformers' one-to-many ``Split``, uneven concatenations and escaped
source patterns exactly as transformers 5.24 loads them.

Each case is a tiny model built from transformers' own config class with random weights, written by
``save_pretrained`` and read back by ``from_pretrained``; its weight map, replayed by the reference
loader over the saved files, must give exactly the tensors transformers loaded and use every tensor
the checkpoint holds. Hostile twins store one source tensor with a wrong shape: the loader refuses it
naming the file, the tensor, the shape found and the shape the map expects.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from kimi_adapter_core.checkpoint.loader import load_weights
from kimi_adapter_core.checkpoint.tensors import TensorType, dtype_name
from kimi_adapter_core.checkpoint.weight_map import LATER_OPS, RULES, weight_map_document
from kimi_adapter_core.errors import KadaptError

SMALL = {"vocab_size": 64, "hidden_size": 32, "max_position_embeddings": 64, "pad_token_id": 0}
SMALL_MOE = {"moe_intermediate_size": 16, "num_experts_per_tok": 2}


@dataclass(frozen=True)
class Case:
    """A model type, its tiny config, the graph weight whose ops the case is about, those ops, and the
    shapes of its source groups (what ``save_pretrained`` writes)."""

    model_type: str
    config: dict[str, Any]
    weight: str
    ops: list[dict[str, Any]]
    source_shapes: list[list[int]]


CASES = [
    # GQA: the fused [q|k|v] rows split by each target's size (64 query rows, 32 key and 32 value rows)
    Case(
        "sarvam_moe",
        {**SMALL, **SMALL_MOE, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "n_routed_experts": 4, "first_k_dense_replace": 1},
        "model.layers.0.self_attn.k_proj.weight",
        [{"op": "split", "dim": 0, "sizes": [64, 32, 32], "index": 1}],
        [[128, 32]],
    ),
    # the gated delta net's fused input projection, rows [q|k|v|z|b|a], split four ways
    Case(
        "lara_mini",
        {**SMALL, **SMALL_MOE, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
         "linear_num_value_heads": 4, "shared_expert_intermediate_size": 16, "num_experts": 4,
         "sliding_window": 8, "layer_types": ["linear_attention", "full_attention"]},
        "model.layers.0.linear_attn.in_proj_z.weight",
        [{"op": "split", "dim": 0, "sizes": [64, 32, 4, 4], "index": 1}],
        [[104, 32]],
    ),
    # q, k and v convolutions of unequal channels concatenated: saved as torch.chunk cuts the 64
    # channels (22, 22, 20), which is what transformers' reverse op writes and its loader reads back
    Case(
        "olmo_hybrid",
        {**SMALL, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "linear_num_key_heads": 2, "linear_num_value_heads": 2,
         "linear_key_head_dim": 8, "linear_value_head_dim": 16,
         "layer_types": ["linear_attention", "full_attention"]},
        "model.layers.0.linear_attn.conv1d.weight",
        [{"op": "concat", "dim": 0}],
        [[22, 1, 4], [22, 1, 4], [20, 1, 4]],
    ),
    # source patterns written as regexes (r"\.experts.*.w1.weight"), merged across experts
    Case(
        "kimi_linear",
        {**SMALL, **SMALL_MOE, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
         "num_key_value_heads": 2, "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
         "v_head_dim": 8, "num_experts": 4, "linear_head_dim": 8, "linear_num_heads": 2,
         "mlp_layer_types": ["dense", "sparse"], "layer_types": ["linear_attention", "full_attention"]},
        "model.layers.1.mlp.experts.gate_up_proj",
        [{"op": "stack", "dim": 0}, {"op": "concat", "dim": 1}],
        [[16, 32], [16, 32]],
    ),
]  # fmt: skip


@dataclass(frozen=True)
class Saved:
    """A case's checkpoint folder, the model transformers loaded from it and its weight map."""

    folder: Path
    loaded: dict[str, torch.Tensor]
    doc: dict[str, Any]


def _saved(case: Case, folder: Path) -> Saved:
    """``case``'s tiny random model written by ``save_pretrained``, loaded back by ``from_pretrained``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(case.model_type, **case.config)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.normal_()
    model.save_pretrained(folder)
    loaded = AutoModelForCausalLM.from_pretrained(folder).eval()
    return Saved(folder, loaded.state_dict(), _weight_map(loaded))


def _weight_map(model: nn.Module) -> dict[str, Any]:
    """The weight map of every parameter (a tied one once) and persistent buffer of ``model`` (what
    ``save_pretrained`` writes), as an extraction writes it."""
    persistent = model.state_dict()
    tensors = [*model.named_parameters(), *((n, b) for n, b in model.named_buffers() if n in persistent)]
    weights = {path: TensorType(tuple(t.shape), dtype_name(t.dtype)) for path, t in tensors}
    spec: Any = SimpleNamespace(quantization=(), locate=lambda where: where)
    return weight_map_document(spec, model, weights, model_name="tiny", renames=())


@pytest.fixture(scope="module", params=CASES, ids=[case.model_type for case in CASES])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Case, Saved]:
    case = request.param
    return case, _saved(case, tmp_path_factory.mktemp(case.model_type))


def test_the_weight_map_replays_what_transformers_loaded(saved: tuple[Case, Saved]) -> None:
    case, result = saved
    entry = result.doc["weights"][case.weight]
    assert entry["ops"] == case.ops
    assert [group["shape"] for group in entry["sources"]] == case.source_shapes
    weights = load_weights(result.doc, result.folder)
    for name, tensor in weights.items():
        assert torch.equal(tensor, result.loaded[name]), name
    with safe_open(str(result.folder / "model.safetensors"), "pt") as handle:
        stored = set(handle.keys())  # noqa: SIM118 - safe_open handles are not iterable
    named = {t for e in result.doc["weights"].values() for g in e["sources"] for t in g["tensors"]}
    assert named == stored  # every checkpoint tensor is read, none is invented


def test_a_map_states_the_rules_of_the_later_ops_it_uses(saved: tuple[Case, Saved]) -> None:
    case, result = saved
    used = {op["op"] for e in result.doc["weights"].values() for op in e["ops"]} & set(LATER_OPS)
    assert result.doc["rules"]["ops"] == {**RULES["ops"], **{k: LATER_OPS[k] for k in used}}
    assert ("split" in used) == (case.ops[0]["op"] == "split")


def test_a_source_tensor_of_the_wrong_shape_is_refused(saved: tuple[Case, Saved], tmp_path: Path) -> None:
    case, result = saved
    group = result.doc["weights"][case.weight]["sources"][-1]
    name, shape = group["tensors"][-1], group["shape"]
    tensors = load_file(str(result.folder / "model.safetensors"))
    tensors[name] = tensors[name][:-1].contiguous()  # one row short
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(KadaptError) as caught:
        load_weights(result.doc, tmp_path)
    found = [shape[0] - 1, *shape[1:]]
    assert str(caught.value) == (
        f"{tmp_path.resolve() / 'model.safetensors'}: tensor {name} is stored float32 {found}, "
        f"the weight map says float32 {shape}"
    )


def _split_map(op: dict[str, Any], rows: int) -> dict[str, Any]:
    """A one-weight map building a [2, 3] weight from one ``rows``-row tensor with ``op``."""
    group = {"tensors": ["fused"], "shape": [rows, 3], "dtype": "float32"}
    return {"weights": {"w": {"shape": [2, 3], "dtype": "float32", "sources": [group], "ops": [op]}}}


def test_split_keeps_its_part(tmp_path: Path) -> None:
    fused = torch.arange(15, dtype=torch.float32).reshape(5, 3)
    save_file({"fused": fused}, str(tmp_path / "model.safetensors"))
    doc = _split_map({"op": "split", "dim": 0, "sizes": [1, 2, 2], "index": 1}, 5)
    assert torch.equal(load_weights(doc, tmp_path)["w"], fused[1:3])


@pytest.mark.parametrize(
    ("op", "message"),
    [
        (
            {"op": "split", "dim": 0, "sizes": [1, 2, 1], "index": 1},
            "weight map: weights['w'].ops[0] (split) cannot apply to [5, 3]: "
            "5 does not split into parts of [1, 2, 1] on dim 0",
        ),
        (
            {"op": "split", "dim": 0, "sizes": [3, 2], "index": 2},
            "weight map: weights['w'].ops[0].index is 2, expected below the number of sizes (2)",
        ),
        (
            {"op": "split", "dim": 0, "sizes": [3, -2], "index": 0},
            "weight map: weights['w'].ops[0].sizes is [3, -2], expected a list of integers >= 0",
        ),
        (
            {"op": "split", "dim": 0, "index": 0},
            "weight map: weights['w'].ops[0] has no 'sizes'",
        ),
    ],
)
def test_a_split_that_does_not_fit_is_refused(op: dict[str, Any], message: str, tmp_path: Path) -> None:
    save_file({"fused": torch.zeros(5, 3)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(KadaptError) as caught:
        load_weights(_split_map(op, 5), tmp_path)
    assert str(caught.value) == message
