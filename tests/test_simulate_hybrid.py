"""``kadapt plan`` and ``kadapt simulate`` on a hybrid stack (issue 36 item 4): Qwen3-Next-80B-A3B's
published config, 36 gated-DeltaNet layers and 12 attention layers.

plan counts the linear layers' weights (to the parameter, against transformers' own model built on
meta) and sizes each state kind: the attention layers' KV cache grows with the context, the linear
layers' conv window and float32 recurrent state do not. simulate prices the linear layers as their
own kernels (not as attention, not skipped) and the attention kernels in the 12 attention layers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator
from kimi_adapter_core.backends.simulation.estimate.planner import make_plan
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import UsageError
from kimi_adapter_core.spec import load_spec

CONFIG = REPO / "specs" / "qwen3_next" / "config.json"
SPEC = """\
apiVersion: kadapt/v1
kind: AdapterSpec
metadata:
  name: qwen3_next
  model: Qwen/Qwen3-Next-80B-A3B-Instruct
  description: Qwen3-Next-80B-A3B for plan and simulate tests.
gate:
  model_type: qwen3_next
source:
  config: qwen3_next/config.json
module_paths:
  language_model: model
  language_layers: model.layers
  lm_head: lm_head
architecture:
  attention: gqa
abi:
  batch: 1
  prefill_len: 128
  max_cache_len: 2048
  dtype: bfloat16
  prefill:
    inputs: [input_ids, attention_mask, position_ids]
    outputs: [logits, "present.{layer}.key", "present.{layer}.value", "present.{layer}.conv",
      "present.{layer}.recurrent"]
  decode:
    inputs: [input_ids, attention_mask, position_ids, cache_position, "past.{layer}.key",
      "past.{layer}.value", "past.{layer}.conv", "past.{layer}.recurrent"]
    outputs: [logits, "present.{layer}.key", "present.{layer}.value", "present.{layer}.conv",
      "present.{layer}.recurrent"]
"""
# per linear layer, whole model: a bf16 conv window [2*16*128 + 32*128, 4] and a float32 state [32, 128, 128]
STATE_PER_LAYER = 8192 * 4 * 2 + 32 * 128 * 128 * 4
ATTENTION_KV_PER_TOKEN = 12 * 2 * 2 * 256 * 2  # 12 layers x (K + V) x 2 KV heads x 256 x bf16


def _write_spec(folder: Path, config: dict[str, Any]) -> Path:
    (folder / "qwen3_next").mkdir(parents=True)
    (folder / "qwen3_next" / "config.json").write_text(json.dumps(config))
    path = folder / "qwen3_next.yaml"
    path.write_text(SPEC)
    return path


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hybrid")
    (folder / "qwen3_next").mkdir()
    shutil.copy(CONFIG, folder / "qwen3_next" / "config.json")
    (folder / "qwen3_next.yaml").write_text(SPEC)
    return folder / "qwen3_next.yaml"


@pytest.fixture(scope="module")
def all_attention(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same model with every layer full attention (and no linear-attention sizes)."""
    config = {k: v for k, v in json.loads(CONFIG.read_text()).items() if not k.startswith("linear_")}
    config["full_attention_interval"] = 1
    return _write_spec(tmp_path_factory.mktemp("full"), config)


def _cli(*args: object) -> dict[str, Any]:
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return json.loads(result.output)


def test_plan_counts_every_parameter_transformers_builds(hybrid: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**json.loads(CONFIG.read_text()))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    expected = sum(p.numel() for p in model.parameters())
    plan = _cli("plan", hybrid, "--format", "json")
    assert plan["weights"]["total_params"] == expected == 79_674_391_296
    groups = {g["group"]: g for g in plan["weights"]["groups"]}
    # the linear layers' own weights under the model's names, in the 36 linear layers only
    in_proj = "model.layers.0.linear_attn.in_proj_qkvz.weight"
    assert groups["linear_attn.in_proj"]["checkpoint_name"] == in_proj
    assert groups["linear_attn.in_proj"]["params"] == 36 * (12288 + 64) * 2048
    assert groups["attn.q_proj"]["checkpoint_name"] == "model.layers.3.self_attn.q_proj.weight"
    assert groups["attn.q_proj"]["params"] == 12 * 2 * 16 * 256 * 2048  # query + output gate


def test_plan_sizes_each_state_kind(hybrid: Path) -> None:
    inputs = model_inputs(load_spec(hybrid), None)
    short, long = (make_plan(inputs, Parallel(tp=8), batch=4, seq_len=n) for n in (4096, 65536))
    for plan in (short, long):
        assert plan.kv.layers == 12 and plan.kv.state is not None and plan.kv.state.layers == 36
        assert plan.kv.state_bytes(per_rank=False) == 36 * STATE_PER_LAYER
        assert plan.kv.state_bytes() == 36 * STATE_PER_LAYER // 8  # heads split over tp=8
    assert inputs.arch.structure.linear.state_bytes_per_request(2) == STATE_PER_LAYER
    # the attention KV grows 16x with the context, the linear state not at all
    assert long.kv.kv_bytes(65536, per_rank=False) == 16 * short.kv.kv_bytes(4096, per_rank=False)
    assert short.kv.kv_bytes(4096, per_rank=False) == 4096 * ATTENTION_KV_PER_TOKEN
    grown = long.memory.kv_cache - short.memory.kv_cache
    assert grown == 4 * (long.kv.kv_bytes(65536) - short.kv.kv_bytes(4096))  # per device: 4 sequences


def test_plan_reports_each_state_kind_in_text_and_json(hybrid: Path) -> None:
    text = CliRunner().invoke(cli, ["plan", str(hybrid), "--tp", "8", "--seq-len", "4096"]).output
    assert "KV cache (12 attention layers, grows with context;" in text
    assert "linear-attention state: 36 layers x 2.06 MiB per request, constant in context" in text
    assert "recurrent  [32x128x128] fp32" in text
    states = _cli("plan", hybrid, "--tp", "8", "--seq-len", "4096", "--format", "json")["states"]
    kv, linear = states["attention_kv"], states["linear_attention"]
    assert (kv["layers"], kv["grows_with_context"], kv["layer_ids"][:2]) == (12, True, [3, 7])
    assert (linear["layers"], linear["grows_with_context"]) == (36, False)
    assert linear["mixer"] == "gated_delta_net"
    assert linear["recurrent"] == {
        "shape": [32, 128, 128],
        "shape_per_device": [4, 128, 128],
        "dtype": "fp32",
        "bytes_per_layer": 32 * 128 * 128 * 4,
        "bytes_per_layer_per_device": 4 * 128 * 128 * 4,
    }
    assert linear["bytes_per_request"] == 36 * STATE_PER_LAYER
    assert states["bytes_per_sequence"] == kv["bytes_per_sequence"] + linear["bytes_per_request"]


def test_tp_must_divide_the_linear_heads(hybrid: Path) -> None:
    s = model_inputs(load_spec(hybrid), None).arch.structure
    uneven = s.linear.__class__(**{**s.linear.__dict__, "num_key_heads": 12})
    with pytest.raises(UsageError, match="does not divide the 12 linear-attention key heads"):
        Parallel(tp=8).check(s.__class__(**{**s.__dict__, "linear": uneven}))


def _decode(spec: Path, context: int, *extra: object) -> dict[str, Any]:
    return _cli(
        "simulate", spec, "--device", "h200", "--tp", "8", "--batch", "8", "--decode",
        "--context-len", context, "--format", "json", *extra,
    )  # fmt: skip


def _ops(sim: dict[str, Any], name: str) -> list[dict[str, Any]]:
    return [op for op in sim["ops"] if op["op"] == name]


@pytest.fixture(scope="module")
def decodes(hybrid: Path, all_attention: Path) -> dict[str, dict[str, Any]]:
    return {
        "short": _decode(hybrid, 1024),
        "long": _decode(hybrid, 65536),
        "full_long": _decode(all_attention, 65536),
    }


def test_simulate_prices_the_linear_layers_as_their_own_kernels(decodes: dict[str, dict[str, Any]]) -> None:
    long = decodes["long"]
    (attention,) = _ops(long, "attention_decode")
    assert attention["count"] == 12 and attention["scope"] == "moe"  # only the attention layers
    for name in ("fused_sigmoid_gating_delta_rule_update", "causal_conv1d_update"):
        (op,) = _ops(long, name)
        assert op["count"] == 36 and op["scope"] == "linear_moe" and op["source"] == "roofline"
        assert op["module"] == "linear_moe_layer.linear_attn"
    mixer = [op for op in long["ops"] if op["module"] == "linear_moe_layer.linear_attn"]
    (in_proj,) = [op for op in mixer if "in_proj" in op["op"]]
    assert in_proj["count"] == 36 and in_proj["source"].startswith("table:")
    assert long["states"]["linear_attention"] == {
        "layers": 36,
        "grows_with_context": False,
        "bytes_per_request_per_device": 36 * STATE_PER_LAYER // 8,
    }
    assert long["states"]["attention_kv"]["layers"] == 12


def test_linear_layers_do_not_grow_with_the_context(decodes: dict[str, dict[str, Any]]) -> None:
    short, long, full = decodes["short"], decodes["long"], decodes["full_long"]

    def seconds(sim: dict[str, Any], kind: str) -> float:
        names = {"linear": ("fused_sigmoid_gating_delta_rule_update", "causal_conv1d_update")}
        return sum(op["time_s"] for op in sim["ops"] if op["op"] in names.get(kind, ("attention_decode",)))

    assert seconds(short, "linear") == seconds(long, "linear") > 0
    assert seconds(long, "attention") > 8 * seconds(short, "attention")
    # 48 attention layers reading a 64k cache against 12: the hybrid decodes faster, by the 36 layers'
    # KV reads less their state updates
    (full_attention,) = _ops(full, "attention_decode")
    assert full_attention["count"] == 48 and not _ops(full, "causal_conv1d_update")
    assert full_attention["time_s"] > 3.5 * seconds(long, "attention")
    saved = full_attention["time_s"] - seconds(long, "attention")
    assert long["step_time_s"] < full["step_time_s"] - 0.9 * saved
    assert "states" not in full
    assert long["memory_per_device"]["kv_cache_bytes"] < full["memory_per_device"]["kv_cache_bytes"] / 3


def test_simulate_prefill_runs_the_chunked_scan(hybrid: Path) -> None:
    sim = _cli(
        "simulate", hybrid, "--device", "h200", "--tp", "8", "--batch", "8", "--query-len", "4096",
        "--format", "json",
    )  # fmt: skip
    (scan,) = _ops(sim, "chunk_gated_delta_rule")
    (conv,) = _ops(sim, "causal_conv1d_fn")
    assert scan["count"] == conv["count"] == 36
    assert scan["source"] == "roofline" and scan["bound"] == "compute"
    tokens, heads = 8 * 4096, 4  # per rank: 32 value heads over tp=8
    assert scan["flops"] == 36 * tokens * heads * (6 * 64 * 128 + 4 * 64 * 128 + 6 * 128 * 128)
    (attention,) = _ops(sim, "flash_attention_prefill")
    assert attention["count"] == 12


@pytest.mark.skipif(not aiconfigurator.available(), reason="AIConfigurator's tables are not installed")
def test_measured_cost_model_reads_aiconfigurators_gated_deltanet_rows(hybrid: Path) -> None:
    sim = _decode(hybrid, 4096, "--cost-model", "measured", "--framework", "vllm")
    for name in ("fused_sigmoid_gating_delta_rule_update", "causal_conv1d_update"):
        (op,) = _ops(sim, name)
        assert op["source"] == "aiconfigurator:h200_sxm/vllm" and op["bound"] == "measured"


SMALL_QWEN3_5 = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=512,
    linear_num_key_heads=4,
    linear_num_value_heads=8,
    linear_key_head_dim=32,
    linear_value_head_dim=32,
    linear_conv_kernel_dim=4,
    vocab_size=1000,
)
SMALL_QWEN3_5_MOE = dict(
    SMALL_QWEN3_5,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    shared_expert_intermediate_size=64,
)


@pytest.mark.parametrize(
    ("module", "config_class", "sizes"),
    [
        ("qwen3_5", "Qwen3_5TextConfig", SMALL_QWEN3_5),
        ("qwen3_5_moe", "Qwen3_5MoeTextConfig", SMALL_QWEN3_5_MOE),
    ],
)
def test_qwen3_5_split_projections_are_counted_under_their_names(
    module: str, config_class: str, sizes: dict[str, int]
) -> None:
    """Qwen3.5 splits the in projection (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a): the inventory
    names every tensor transformers builds, each with its size."""
    import importlib

    from transformers import AutoModelForCausalLM

    from kimi_adapter_core.backends.simulation.model.params import Naming, text_groups
    from kimi_adapter_core.structure.derive import derive_structure

    config = getattr(importlib.import_module(f"transformers.models.{module}"), config_class)(**sizes)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    theirs = {name: p.numel() for name, p in model.named_parameters()}
    groups = text_groups(derive_structure(config.to_dict()), Naming("model", "model.layers", "lm_head", ()))
    mine = {name: params for group in groups for name, params in group.tensors()}
    assert mine == theirs
    assert "model.layers.0.linear_attn.in_proj_z.weight" in mine
