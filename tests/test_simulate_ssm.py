"""``kadapt plan`` and ``kadapt simulate`` on KDA and Mamba2 stacks (issue 36 item 4): Granite-4.0-H
(Mamba2 layers in ``mamba``, GQA attention), Kimi-Linear and Bailing-hybrid (KDA layers in
``self_attn``), built from transformers' own config classes.

plan names each mixer's tensors as transformers builds them (checked against the model built on meta)
and sizes their states as ``DynamicCache`` holds them after a prefill of a tiny CPU model; simulate
prices each mixer as its serving kernels (conv + chunked scan in prefill, conv update + state update in
decode): constant in the context where attention grows, linear in the prefill tokens.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

from kimi_adapter_core.backends.simulation.model.params import Naming, text_groups
from kimi_adapter_core.cli import cli
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import write_spec
from kimi_adapter_core.structure.derive import derive_structure

PATHS = {"language_model": "model", "language_layers": "model.layers", "lm_head": "lm_head"}
GRANITE = {"position_embedding_type": "rope"}  # simulate calls the text model's rotary embedding
KIMI = {"mlp_layer_types": ["sparse"] * 5}  # the structure reads no per-layer MLP list (see the report)
# every layer built per rank: rank_config cuts layer_types to the traced layers, not mlp_layer_types
BAILING = {
    "num_hidden_layers": 2,
    "layer_types": ["linear_attention"] * 2,
    "mlp_layer_types": ["dense", "sparse"],
}
MEDIUM_GRANITE = GRANITE | {
    "hidden_size": 2048, "num_attention_heads": 16, "num_key_value_heads": 4, "mamba_n_heads": 64,
    "mamba_d_head": 64, "mamba_n_groups": 2, "mamba_d_state": 128, "mamba_expand": 2, "mamba_chunk_size": 256,
    "intermediate_size": 1024, "shared_intermediate_size": 1024, "num_hidden_layers": 4,
    "layer_types": ["mamba", "mamba", "mamba", "attention"], "vocab_size": 32000,
}  # fmt: skip
MEDIUM_BAILING = BAILING | {"hidden_size": 1024, "linear_num_heads": 16, "linear_head_dim": 128}


def _config(model_type: str, sizes: dict[str, Any]) -> Any:
    return AutoConfig.for_model(**{**tiny_config(model_type), **sizes})


def _spec(folder: Path, model_type: str, sizes: dict[str, Any]) -> Path:
    raw = _config(model_type, sizes).to_dict()
    raw["max_position_embeddings"] = 131072  # KDA configs spell it model_max_length (see the report)
    return write_spec(folder, model_type, raw, PATHS)


def _cli(*args: object) -> dict[str, Any]:
    result = CliRunner().invoke(cli, [str(a) for a in args])
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    return json.loads(result.output)


def _built(model_type: str, sizes: dict[str, Any]) -> tuple[Any, dict[str, tuple[int, ...]], dict[str, int]]:
    """transformers' model on meta: every parameter's shape, and the plan's inventory of the same config."""
    config = _config(model_type, sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    theirs = {name: tuple(p.shape) for name, p in model.named_parameters()}
    groups = text_groups(derive_structure(config.to_dict()), Naming("model", "model.layers", "lm_head", ()))
    mine = {name: params for group in groups for name, params in group.tensors()}
    return config, theirs, mine


def _numel(shape: tuple[int, ...]) -> int:
    return int(torch.Size(shape).numel())


def test_kimi_linear_plan_names_every_tensor_transformers_builds() -> None:
    _, theirs, mine = _built("kimi_linear", KIMI)
    assert mine == {name: _numel(shape) for name, shape in theirs.items()}
    # KDA's low-rank decay and output gate, A_log one per head in Kimi's [1, 1, H, 1]
    assert theirs["model.layers.0.self_attn.forget_gate.f_b_proj.weight"] == (16, 8)
    assert theirs["model.layers.0.self_attn.forget_gate.A_log"] == (1, 1, 2, 1)
    assert "model.layers.0.self_attn.g_a_proj.weight" in mine


def test_bailing_and_granite_mixer_tensors_are_named_and_sized_as_transformers_builds_them() -> None:
    """The KDA (full-rank gates) and Mamba2 mixers to the tensor; the rest of each inventory is the
    attention / MLP one of every family (Granite's ``block_sparse_moe`` and ``shared_mlp`` and
    Bailing's MLA gate are not the conventional names: see the report)."""
    cases = (("bailing_hybrid", BAILING, ".self_attn."), ("granitemoehybrid", GRANITE, ".mamba."))
    for model_type, sizes, mixer in cases:
        _, theirs, mine = _built(model_type, sizes)
        built = {n: _numel(s) for n, s in theirs.items() if mixer in n}
        assert built and {n: p for n, p in mine.items() if mixer in n} == built
    _, theirs, mine = _built("granitemoehybrid", GRANITE)
    # z, x, B, C, dt: 2 x 64 + 2 groups x 2 x 16 + 4 heads; the conv over x, B and C with its bias
    assert theirs["model.layers.0.mamba.in_proj.weight"] == (196, 64)
    assert mine["model.layers.0.mamba.conv1d.bias"] == 128
    outside = {n for n in theirs if "block_sparse_moe" not in n and "shared_mlp" not in n}
    assert {n: mine[n] for n in outside} == {n: _numel(theirs[n]) for n in outside}


@pytest.mark.parametrize(
    ("model_type", "sizes", "conv", "recurrent"),
    [("granitemoehybrid", GRANITE, [128, 4], [4, 16, 16]), ("kimi_linear", KIMI, [48, 4], [2, 8, 8])],
)
def test_plan_state_bytes_are_what_dynamic_cache_holds_after_a_prefill(
    tmp_path: Path, model_type: str, sizes: dict[str, Any], conv: list[int], recurrent: list[int]
) -> None:
    config = _config(model_type, sizes)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.bfloat16).eval()
    cache = DynamicCache(config=config)
    with torch.no_grad():
        model(torch.arange(1, 9).unsqueeze(0), cache=cache, use_cache=True)
    linear = [i for i, kind in enumerate(config.layer_types) if kind == "linear_attention"]
    states = [t for i in linear for t in (cache.get_conv_state(i), cache.get_recurrent_state(i))]
    held = sum(t.numel() * t.element_size() for t in states)
    plan = _cli("plan", _spec(tmp_path, model_type, sizes), "--format", "json")
    state = plan["states"]["linear_attention"]
    assert state["bytes_per_request"] == held > 0
    assert (state["conv"]["shape"], state["recurrent"]["shape"]) == (conv, recurrent)
    assert [list(states[0].shape[1:]), list(states[1].shape[1:])] == [conv, recurrent]
    assert (state["conv"]["dtype"], state["recurrent"]["dtype"]) == ("bf16", "fp32")
    assert (states[0].dtype, states[1].dtype) == (torch.bfloat16, torch.float32)


def _ops(sim: dict[str, Any], *names: str) -> list[dict[str, Any]]:
    return [op for op in sim["ops"] if op["op"] in names]


def _seconds(sim: dict[str, Any], *names: str) -> float:
    return sum(op["time_s"] for op in _ops(sim, *names))


def _simulate(spec: Path, *args: object) -> dict[str, Any]:
    return _cli("simulate", spec, "--device", "h200", "--tp", 2, "--batch", 8, "--format", "json", *args)


@pytest.fixture(scope="module")
def granite(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _spec(tmp_path_factory.mktemp("granite"), "granitemoehybrid", MEDIUM_GRANITE)


def test_mamba2_decode_is_constant_in_the_context_where_attention_grows(granite: Path) -> None:
    short, long = (_simulate(granite, "--decode", "--context-len", n) for n in (1024, 65536))
    linear = ("causal_conv1d_update", "selective_state_update")
    for sim in (short, long):
        for op in _ops(sim, *linear):
            assert (op["count"], op["module"], op["source"]) == (3, "linear_moe_layer.mamba", "roofline")
    assert _seconds(short, *linear) == _seconds(long, *linear) > 0
    assert _seconds(long, "attention_decode") > 8 * _seconds(short, "attention_decode")
    (update,) = _ops(long, "selective_state_update")
    # per rank 32 heads x 64 x state 128: 5 P N FLOPs per token and head; the fp32 state read and written
    assert update["flops"] == 3 * 8 * 32 * 5 * 64 * 128
    assert update["bytes"] >= 3 * 2 * 8 * 32 * 64 * 128 * 4
    assert long["states"]["linear_attention"]["layers"] == 3


def test_mamba2_prefill_scan_grows_linearly_in_tokens(granite: Path) -> None:
    short, long = (_simulate(granite, "--query-len", n) for n in (1024, 4096))
    (scan,) = _ops(short, "mamba_chunk_scan_combined")
    (scan4,) = _ops(long, "mamba_chunk_scan_combined")
    per_token = 2 * 256 * 128 * 1 + 32 * (2 * 256 * 64 + 4 * 128 * 64)  # G=1, H=32 per rank, L=256
    assert scan["flops"] == 3 * 8 * 1024 * per_token and scan4["flops"] == 4 * scan["flops"]
    assert 3.5 < scan4["time_s"] / scan["time_s"] <= 4.0
    (conv,) = _ops(long, "causal_conv1d_fn")
    assert conv["flops"] == 3 * 2 * 8 * 4096 * (32 * 64 + 2 * 1 * 128) * 4  # 2 T C K over x, B and C
    # attention's prefill grows faster than its tokens
    assert _seconds(long, "flash_attention_prefill") > 5 * _seconds(short, "flash_attention_prefill")


def test_kda_is_priced_as_its_serving_kernels(tmp_path: Path) -> None:
    spec = _spec(tmp_path, "bailing_hybrid", MEDIUM_BAILING)
    short, long = (_simulate(spec, "--decode", "--context-len", n) for n in (1024, 65536))
    linear = ("causal_conv1d_update", "fused_recurrent_kda")
    assert _seconds(short, *linear) == _seconds(long, *linear) > 0
    heads, d = 8, 128  # 16 heads over tp 2
    (update,) = [op for op in _ops(long, "fused_recurrent_kda") if op["scope"] == "linear_moe"]
    assert update["module"] == "linear_moe_layer.self_attn" and update["flops"] == 8 * heads * 7 * d * d
    prefills = [_simulate(spec, "--query-len", n) for n in (1024, 4096)]
    scans = [sum(op["flops"] for op in _ops(sim, "chunk_kda")) for sim in prefills]
    assert scans[0] == 2 * 8 * 1024 * heads * (10 * 64 * d + 6 * d * d) and scans[1] == 4 * scans[0]
    projections = {op["module"] for op in prefills[0]["ops"] if op["module"].startswith("linear_moe_layer.")}
    assert "linear_moe_layer.self_attn.forget_gate.f_proj" in projections
