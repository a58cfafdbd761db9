"""``kadapt simulate``: one traced step is positive, internally consistent and moves the right way."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from fixtures.loader import loaded_dtypes
from fixtures.spec_files import KIMI_SPEC, REPO, kimi_spec_with

from kimi_adapter_core.backends.simulation.estimate.simulator import Simulation, simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.mla_kernels import RankMLA
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.rank_model import build_rank
from kimi_adapter_core.backends.simulation.model.serving_kernels import RoutedExperts
from kimi_adapter_core.backends.simulation.model.tracer import Recorder
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied
from kimi_adapter_core.spec import Spec, load_spec


@pytest.fixture(scope="module")
def spec_path() -> Path:
    return REPO / "specs" / "kimi_k25.yaml"


@pytest.fixture(scope="module")
def spec() -> Spec:
    return KIMI_SPEC


def run(
    spec: Spec,
    *,
    tp: int = 8,
    dp: int = 1,
    ep: int = 8,
    batch: int = 32,
    query_len: int = 1,
    context_len: int = 4096,
    decode: bool = True,
    mtp: int = 0,
    quant: str | None = None,
    device: str = "h200",
) -> Simulation:
    inputs = model_inputs(spec, quant)
    dep = Deployment(Parallel(tp, dp, ep), batch, query_len, context_len, decode, mtp)
    return simulate(inputs, spec, dep, get_device(device))


@pytest.fixture(scope="module")
def decode(spec: Spec) -> Simulation:
    return run(spec)


@pytest.fixture(scope="module")
def prefill(spec: Spec) -> Simulation:
    return run(spec, batch=4, query_len=2048, context_len=0, decode=False)


@pytest.mark.parametrize("which", ["decode", "prefill"])
def test_step_is_positive_and_sums(which: str, request: pytest.FixtureRequest) -> None:
    sim: Simulation = request.getfixturevalue(which)
    rows = sim.rows()
    # decode hides the shared experts behind the routed path (priced 0, bound "overlapped")
    assert sim.step_time > 0 and all(r.time > 0 or r.bound == "overlapped" for r in rows)
    assert sum(r.time for r in rows) == pytest.approx(sim.step_time)  # the table accounts for the whole step
    names = {r.name for r in rows}
    assert "grouped_gemm(routed_experts)" in names and "tp_all_reduce" in names
    # TP8 EP8: the EP group lies inside the TP group, whose ranks all hold the tokens (no all-to-all)
    assert not any(name.startswith("ep_") for name in names)
    assert ("mla_decode_attention" if which == "decode" else "flash_attention_prefill") in names
    moe_rows = [r for r in rows if r.scope == "moe" and r.name == "grouped_gemm(routed_experts)"]
    assert moe_rows[0].count == 60  # one traced MoE layer stands for the 60 MoE layers


def test_tokens_per_second(decode: Simulation, prefill: Simulation) -> None:
    assert decode.tokens_per_s_per_device == pytest.approx(32 / decode.step_time / 8)
    assert prefill.tokens_per_s_per_device == pytest.approx(4 * 2048 / prefill.step_time / 8)
    assert prefill.step_time > decode.step_time


def test_decode_time_grows_with_context(spec: Spec, decode: Simulation) -> None:
    assert run(spec, context_len=32768).step_time > decode.step_time > run(spec, context_len=512).step_time


def test_more_tp_less_weight_per_device(spec: Spec, decode: Simulation) -> None:
    narrow = run(spec, tp=4, ep=4)
    assert decode.memory.weights < narrow.memory.weights
    assert decode.memory.kv_cache == 32 * (4096 + 1) * 1152 * 61  # latent KV, replicated over TP
    assert narrow.memory.kv_cache == decode.memory.kv_cache


def test_quant_modes_change_prices(spec: Spec) -> None:
    w4a8, bf16 = run(spec, quant="W4A8", dp=2, ep=16, tp=8), run(spec, quant="BF16", dp=2, ep=16, tp=8)
    assert w4a8.memory.weights < bf16.memory.weights
    assert w4a8.step_time < bf16.step_time  # decode reads weights: 4-bit is faster


def test_a_dense_config_traces_bf16_experts(decode: Simulation, tmp_path: Path) -> None:
    """A Kimi-K2.5 config without quantization_config is a dense checkpoint (extraction reads it so):
    the routed experts run the bf16 grouped GEMM and read 16 bits a weight instead of the shipped
    int4's 4 + 16/32, and a note says the spec's Q1 was not applied."""
    dense = run(load_spec(kimi_spec_with(tmp_path, lambda text: text.pop("quantization_config"))))

    def experts(sim: Simulation) -> Any:
        return next(k.op for k in sim.kernels if k.op.name == "grouped_gemm(routed_experts)")

    assert (experts(decode).attrs["kernel"], experts(dense).attrs["kernel"]) == ("w4a16", "bf16")
    assert experts(dense).bytes > 3 * experts(decode).bytes  # weight reads dominate a decode step
    assert dense.memory.weights > 3 * decode.memory.weights and dense.step_time > decode.step_time
    assert [w for w in dense.warnings if w.startswith("quantization[0] (Q1, int4") and "not applied" in w]
    assert not [w for w in decode.warnings if "quantization" in w]


def test_mtp_verifies_more_tokens(spec: Spec, decode: Simulation) -> None:
    sim = run(spec, mtp=3)
    assert sim.deployment.tokens_per_query == 4
    assert {r.scope for r in sim.rows()} >= {"mtp"}
    assert any("no MTP layers" in w for w in sim.warnings)
    assert sim.deployment.output_tokens == pytest.approx(32 * (1 + 3 * 0.7))


def test_memory_overflow_warns(spec: Spec) -> None:
    sim = run(spec, tp=1, ep=1, batch=1, device="a100")
    assert sim.memory.free is not None and sim.memory.free < 0
    assert any("does not fit" in w for w in sim.warnings)


def test_bad_sizes(spec: Spec) -> None:
    with pytest.raises(KadaptError, match="attention heads"):
        run(spec, tp=3, ep=3)
    with pytest.raises(KadaptError, match="add --decode"):
        run(spec, decode=False, mtp=1)


def test_cli_decode_json_and_trace(spec_path: Path, tmp_path: Path) -> None:
    trace = tmp_path / "step.trace.json"
    result = CliRunner().invoke(
        cli,
        [
            "simulate",
            str(spec_path),
            "--device",
            "h200",
            "--tp",
            "8",
            "--ep",
            "8",
            "--batch",
            "32",
            "--context-len",
            "4096",
            "--decode",
            "--format",
            "json",
            "--trace",
            str(trace),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["phase"] == "decode" and data["tokens_per_s_per_device"] > 0
    assert sum(op["time_s"] for op in data["ops"]) == pytest.approx(data["step_time_s"])
    events = [e for e in json.loads(trace.read_text())["traceEvents"] if e["ph"] == "X"]
    assert sum(e["dur"] for e in events) == pytest.approx(data["step_time_s"] * 1e6)


def test_cli_prefill_text(spec_path: Path) -> None:
    result = CliRunner().invoke(
        cli,
        [
            "simulate",
            str(spec_path),
            "--device",
            "atlas_800_a3",
            "--tp",
            "8",
            "--dp",
            "2",
            "--ep",
            "16",
            "--batch",
            "2",
            "--query-len",
            "1024",
            "--quant",
            "W4A8",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "prefill on atlas_800_a3" in result.output and "tokens/s per device" in result.output


@pytest.mark.parametrize(
    "args, code, message",
    [
        (["--device", "tpu9"], 2, "known devices: a100, atlas_800_a3, b200, gb200, h100, h200, h800"),
        (["--device", "h200", "--quant", "NF4"], 2, "BF16, W8A8, W4A8, W4A16"),
        (["--device", "h200", "--tp", "8", "--ep", "7"], 2, "does not divide"),
        (["--device", "h200", "--decode", "--query-len", "4"], 2, "--query-len"),
    ],
)
def test_cli_errors(spec_path: Path, args: list[str], code: int, message: str) -> None:
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), *args])
    assert result.exit_code == code, result.output
    assert message in result.output


# --- the per-rank model is the spec's model ---------------------------------------------------------


def variant(spec_path: Path, tmp: Path, edit: Any) -> Spec:
    """A copy of the sizing spec (its config next to it) after ``edit(raw_yaml_dict)``."""
    raw = yaml.safe_load(spec_path.read_text(encoding="utf-8"))
    edit(raw)
    (tmp / "kimi_k25").mkdir(exist_ok=True)
    (tmp / "kimi_k25" / "config.json").write_bytes(
        (spec_path.parent / "kimi_k25" / "config.json").read_bytes()
    )
    copy = tmp / "variant.yaml"
    copy.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return load_spec(copy)


def test_traced_modules_are_the_spec_classes(spec: Spec) -> None:
    inputs = model_inputs(spec, None)
    dep = Deployment(Parallel(8, 1, 8), 32, 1, 4096, True, 0)
    with applied(spec, backend="simulation"), torch.device("meta"):
        parts, notes = build_rank(spec, inputs, dep, Recorder())
    assert notes == []  # the shipped bridges change no text size
    assert [(t.kind.kind, t.kind.index, len(t.kind.layers)) for t in parts.layers] == [
        ("dense", 0, 1),
        ("moe", 1, 60),
    ]
    assert len(parts.attention) == 2 and all(isinstance(m, RankMLA) for m in parts.attention)
    assert {m.adopted.__name__ for m in parts.attention} == {spec.mla["attention_class"]}
    assert [m.heads for m in parts.attention] == [64 // 8, 64 // 8]  # per-rank heads, from the override
    moe_layer, dense_layer = parts.layer("moe"), parts.layer("dense")
    assert moe_layer is not None and dense_layer is not None
    moe = moe_layer.mlp
    assert type(moe).__name__ == spec.moe["moe_class"]
    assert isinstance(moe.experts, RoutedExperts) and parts.experts == [moe.experts]
    assert type(moe.gate).__name__ == spec.moe["gate_class"]
    # weights as transformers' loader gives them: the correction bias fp32, the router weight as
    # from_pretrained(dtype=bf16) loads it (fp32 since transformers 5.24)
    loaded = loaded_dtypes("deepseek_v3")
    assert moe.gate.weight.dtype == loaded["model.layers.1.mlp.gate.weight"]
    assert moe.gate.e_score_correction_bias.dtype == torch.float32
    assert dense_layer.mlp.gate_proj.weight.shape == (18432 // 8, 7168)  # per-rank dense width
    assert moe.shared_experts.gate_proj.weight.shape == (2048 // 8, 7168)  # per-rank shared width
    assert parts.lm_head.weight.shape == (163840 // 8, 7168)  # vocab-parallel slice


def test_unknown_attention_class_is_named(spec_path: Path, tmp_path: Path) -> None:
    bad = variant(spec_path, tmp_path, lambda raw: raw["mla"].update(attention_class="KimiMLAttention"))
    with pytest.raises(KadaptError) as info:
        run(bad)
    message = str(info.value)
    assert "mla.attention_class = 'KimiMLAttention' matches no module" in message
    assert "in model.language_model.layers.0" in message  # the first traced layer (the dense one)
    assert "DeepseekV3Attention, DeepseekV3DecoderLayer, DeepseekV3MLP" in message  # what it holds instead
    assert info.value.location and info.value.location.startswith(str(bad.path))


def test_attention_class_without_mla_fields(spec_path: Path, tmp_path: Path) -> None:
    bad = variant(spec_path, tmp_path, lambda raw: raw["mla"].update(attention_class="DeepseekV3MLP"))
    with pytest.raises(KadaptError, match="DeepseekV3MLP has no num_heads"):
        run(bad)


def test_spec_without_mla_attention_class(spec_path: Path, tmp_path: Path) -> None:
    bad = variant(spec_path, tmp_path, lambda raw: raw.pop("mla"))
    with pytest.raises(KadaptError, match="has no mla.attention_class: simulate swaps"):
        run(bad)


def test_experts_found_by_structure_without_experts_class(
    spec_path: Path, tmp_path: Path, decode: Simulation
) -> None:
    """Without moe.experts_class, the experts are the module holding the stacked [384, ...] weights."""
    loose = variant(
        spec_path, tmp_path, lambda raw: (raw["moe"].pop("experts_class"), raw["moe"].pop("gate_class"))
    )
    sim = run(loose)
    assert sim.step_time == pytest.approx(decode.step_time)
    assert any(r.name == "grouped_gemm(routed_experts)" and r.count == 60 for r in sim.rows())


def test_unknown_experts_class_is_named(spec_path: Path, tmp_path: Path) -> None:
    bad = variant(spec_path, tmp_path, lambda raw: raw["moe"].update(experts_class="KimiExperts"))
    with pytest.raises(
        KadaptError,
        match="moe.experts_class = 'KimiExperts' matches no module in model.language_model.layers.1",
    ):
        run(bad)


def _bridge(raw: dict[str, Any], path: str, value: Any) -> None:
    raw["config_bridges"].append(
        {"id": "T1", "why": "test", "op": "set", "path": path, "value": value, "backends": ["simulation"]}
    )


def test_bridge_changing_a_traced_size_is_honoured(
    spec_path: Path, tmp_path: Path, decode: Simulation
) -> None:
    narrow = variant(spec_path, tmp_path, lambda raw: _bridge(raw, "text_config.q_lora_rank", 768))

    def q_a_flops(sim: Simulation) -> float:  # q_a_proj runs merged with kv_a_proj_with_mqa (one GEMM)
        return next(
            r.flops for r in sim.rows() if r.scope == "moe" and r.name == "mm(q_a_proj+kv_a_proj_with_mqa)"
        )

    sim = run(narrow)
    kv_a = 512 + 64  # kv_lora_rank + qk_rope_head_dim
    assert q_a_flops(decode) == 2 * 32 * 7168 * (1536 + kv_a) * 60  # the shipped q_lora_rank
    assert q_a_flops(sim) == 2 * 32 * 7168 * (768 + kv_a) * 60  # the bridged one reached the traced module
    assert any("q_lora_rank from 1536 to 768" in w for w in sim.warnings)


def test_bridge_may_not_undo_a_per_rank_size(spec_path: Path, tmp_path: Path) -> None:
    bad = variant(spec_path, tmp_path, lambda raw: _bridge(raw, "text_config.num_attention_heads", 64))
    with pytest.raises(KadaptError, match="num_attention_heads = 64 over the per-rank value 8"):
        run(bad)


DEEPSEEK_V3 = "transformers.models.deepseek_v3.modeling_deepseek_v3"


def test_gated_patches_reach_the_traced_model(spec_path: Path, tmp_path: Path) -> None:
    def probe(raw: dict[str, Any]) -> None:
        raw["patches"] = [
            {
                "id": "T2",
                "why": "test: a simulation-only attribute on the spec's decoder layers",
                "target": f"{DEEPSEEK_V3}:DeepseekV3DecoderLayer.kadapt_probe",
                "kind": "set_attribute",
                "value": 7,
                "backends": ["simulation"],
            }
        ]

    patched = variant(spec_path, tmp_path, probe)
    inputs = model_inputs(patched, None)
    dep = Deployment(Parallel(8, 1, 8), 32, 1, 4096, True, 0)
    with applied(patched, backend="simulation"), torch.device("meta"):
        parts, _ = build_rank(patched, inputs, dep, Recorder())
        moe_layer = parts.layer("moe")
        assert moe_layer is not None and moe_layer.kadapt_probe == 7  # claimed for the spec
