"""``kadapt plan`` and ``kadapt simulate`` for every shipped spec (exit status, structure, inventory),
and against figures worked out by hand here: GQA (Llama-3.1-8B), GQA + sliding windows (Mistral-7B),
GQA MoE with no dense layer and no shared expert (Qwen3-235B-A22B), MLA MoE with an FP8 checkpoint
(DeepSeek-V3); Kimi-K2.5's own figures are in ``test_plan.py`` / ``test_simulate.py``."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from kimi_adapter_core.backends.simulation.estimate.planner import Plan, make_plan
from kimi_adapter_core.backends.simulation.estimate.simulator import Simulation, simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.rank_model import build_rank
from kimi_adapter_core.backends.simulation.model.serving_kernels import attended_pairs
from kimi_adapter_core.backends.simulation.model.tracer import Recorder
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.structure.model import ModelStructure

REPO = Path(__file__).resolve().parents[1]
# discovered, so a new shipped spec is planned and simulated here without editing this file
SHIPPED = tuple(sorted(p.stem for p in (REPO / "specs").glob("*.yaml") if p.stem != "kimi_k25_remote"))

_SPECS: dict[str, Spec] = {}


def test_a_remote_code_spec_is_refused_before_any_work(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """kimi_k25_remote runs the hub's own Python, which ``simulate`` does not run (it takes no
    ``--trust-remote-code``): refused at the spec's source, naming the shipped spec that prices the same
    model through a transformers class, before the config is read or anything traced. ``plan`` sizes it
    from its config."""

    def no_work(*_: object) -> None:
        raise AssertionError("simulate read the model before refusing it")

    monkeypatch.setattr("kimi_adapter_core.cli.simulate.model_inputs", no_work)
    remote = REPO / "specs" / "kimi_k25_remote.yaml"
    result = CliRunner().invoke(cli, ["simulate", str(remote), "--device", "h200", "--tp", "8"])
    assert result.exit_code == 1, result.output
    assert f"{remote}:" in result.output and "does not run" in result.output
    assert "kimi_k25.yaml" in result.output  # the same metadata.model, through transformers' classes
    assert "--trust-remote-code" not in result.output and "Traceback" not in result.output
    # alone in its folder, it names no alternative
    shutil.copytree(REPO / "specs" / "kimi_k25_remote", tmp_path / "kimi_k25_remote")
    alone = tmp_path / remote.name
    alone.write_text(remote.read_text(encoding="utf-8"), encoding="utf-8")
    lonely = CliRunner().invoke(cli, ["simulate", str(alone), "--device", "h200"])
    assert lonely.exit_code == 1 and "no spec beside it prices this model" in lonely.output, lonely.output
    monkeypatch.undo()
    assert CliRunner().invoke(cli, ["plan", str(remote)]).exit_code == 0


def shipped(name: str) -> Spec:
    if name not in _SPECS:
        _SPECS[name] = load_spec(REPO / "specs" / f"{name}.yaml")
    return _SPECS[name]


def plan(
    spec: Spec, quant: str | None = None, *, tp: int = 1, dp: int = 1, ep: int = 1, **kwargs: Any
) -> Plan:
    return make_plan(model_inputs(spec, quant), Parallel(tp, dp, ep), **kwargs)


def run(
    spec: Spec,
    *,
    tp: int = 8,
    dp: int = 1,
    ep: int = 1,
    batch: int = 32,
    query_len: int = 1,
    context_len: int = 8192,
    decode: bool = True,
    quant: str | None = None,
    device: str = "h200",
) -> Simulation:
    dep = Deployment(Parallel(tp, dp, ep), batch, query_len, context_len, decode)
    return simulate(model_inputs(spec, quant), spec, dep, get_device(device))


def row(sim: Simulation, name: str, scope: str | None = None):  # noqa: ANN201 - an OpRow
    return next(r for r in sim.rows() if r.name == name and (scope is None or r.scope == scope))


def variant(
    name: str, tmp: Path, edit: Callable[[dict], Any], config: Callable[[dict], Any] | None = None
) -> Spec:
    """A copy of shipped spec ``name`` (and its config folder) after ``edit(spec)`` / ``config(json)``."""
    raw = yaml.safe_load((REPO / "specs" / f"{name}.yaml").read_text(encoding="utf-8"))
    edit(raw)
    shutil.copytree(REPO / "specs" / name, tmp / name)
    if config is not None:
        cfg_path = tmp / name / "config.json"
        cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
        config(cfg)
        cfg_path.write_text(json.dumps(cfg), encoding="utf-8")
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return load_spec(path)


# --- plan: parameters --------------------------------------------------------------------------------


def test_llama_parameters() -> None:
    h, vocab, inter = 4096, 128256, 14336
    layer = h * 32 * 128 + 2 * h * 8 * 128 + 32 * 128 * h + 3 * h * inter + 2 * h  # q, k+v, o, MLP, norms
    p = plan(shipped("llama"))
    assert p.total_params == 2 * vocab * h + h + 32 * layer == 8_030_261_248  # untied lm_head
    assert p.active_params == p.total_params  # dense
    assert p.weight_bytes == 2 * p.total_params  # bf16 as shipped
    groups = {w.group.name for w in p.weights}
    assert "router" not in groups and "attn.kv_b_proj" not in groups
    names = {w.group.name: w.group for w in p.weights}
    assert names["attn.k_proj"].checkpoint_names[31] == ("model.layers.31.self_attn.k_proj.weight",)
    assert names["lm_head"].checkpoint_name == "lm_head.weight"  # flat model: no renames


def test_qwen3_moe_parameters() -> None:
    h, vocab, experts, width = 4096, 151936, 128, 1536
    attention = h * 64 * 128 + 2 * h * 4 * 128 + 64 * 128 * h + 2 * h
    router, expert = experts * h, 3 * h * width
    p = plan(shipped("qwen3_moe"))
    assert (
        p.total_params == 2 * vocab * h + h + 94 * (attention + router + experts * expert) == 235_093_610_496
    )
    assert p.active_params == 2 * vocab * h + h + 94 * (attention + router + 8 * expert) == 22_190_739_456
    groups = {w.group.name for w in p.weights}
    assert {"router", "routed_experts"} <= groups
    assert not groups & {"router_bias", "shared_experts", "dense_mlp"}  # softmax routing, no shared, all MoE


def test_deepseek_v3_parameters_and_fp8_checkpoint() -> None:
    h, vocab = 7168, 129280
    attention = h * 1536 + 1536 + 1536 * 128 * 192 + h * 576 + 512 + 512 * 128 * 256 + 128 * 128 * h + 2 * h
    expert = 3 * h * 2048
    moe = 256 * h + 256 + expert + 256 * expert  # router + correction bias + shared + routed
    p = plan(shipped("deepseek_v3"))
    assert p.total_params == 2 * vocab * h + h + 61 * attention + 3 * 3 * h * 18432 + 58 * moe
    assert 670e9 < p.total_params < 672e9  # "671B" (the MTP block is not counted)
    lines = {w.group.name: w for w in p.weights}
    fp8 = 1 + 4 / (128 * 128)  # e4m3 + one fp32 scale per 128x128 block
    routed = lines["routed_experts"]
    assert routed.format == "fp8/b128x128" and routed.total_bytes == pytest.approx(routed.params * fp8)
    assert lines["attn.kv_b_proj"].format == lines["dense_mlp"].format == "fp8/b128x128"
    assert lines["router"].format == lines["embed_tokens"].format == lines["lm_head"].format == "bf16"
    assert lines["router_bias"].format == "fp32"
    # ~673 GB: the published ~688 GB include the MTP block's ~14B parameters, which are not counted
    assert 670e9 < p.weight_bytes < 676e9
    assert plan(shipped("deepseek_v3"), "BF16").weight_bytes == pytest.approx(2 * p.total_params, rel=1e-6)


# --- plan: KV cache -----------------------------------------------------------------------------------


def test_llama_kv_bytes() -> None:
    p = plan(shipped("llama"), seq_len=8192)
    assert p.kv.layout == "heads" and p.kv.layouts() == {"heads": 2 * 8 * 128 * 2}
    assert p.kv.bytes_per_token == 32 * 2 * 8 * 128 * 2 == 131072
    assert p.memory.kv_cache == 8192 * 131072
    assert plan(shipped("llama"), seq_len=8192, tp=4).memory.kv_cache == 8192 * 131072 // 4  # 2 of 8 heads


def test_gqa_kv_heads_replicate_past_tp() -> None:
    """TP 16 over 8 KV heads: each rank holds one KV head, two ranks per head (as vLLM replicates)."""
    tp8, tp16 = plan(shipped("llama"), seq_len=8192, tp=8), plan(shipped("llama"), seq_len=8192, tp=16)
    assert tp8.kv.rank_bytes_per_token_layer == tp16.kv.rank_bytes_per_token_layer == 2 * 128 * 2
    assert tp16.memory.kv_cache == tp8.memory.kv_cache == 8192 * 32 * 512
    k16 = next(w for w in tp16.weights if w.group.name == "attn.k_proj")
    q16 = next(w for w in tp16.weights if w.group.name == "attn.q_proj")
    assert k16.params_per_device == k16.params // 8  # one whole KV head of 8, not half of one
    assert q16.params_per_device == q16.params // 16  # 2 of the 32 query heads


def test_mistral_kv_capped_at_the_window() -> None:
    per_token_layer = 2 * 8 * 128 * 2
    full = plan(shipped("mistral"))
    assert full.seq_len == 32768 and full.kv.windows == (4096,) * 32
    assert full.memory.kv_cache == 32 * 4096 * per_token_layer  # not 32768 tokens
    assert plan(shipped("mistral"), seq_len=4096).memory.kv_cache == full.memory.kv_cache
    assert plan(shipped("mistral"), seq_len=2048).memory.kv_cache == 32 * 2048 * per_token_layer
    assert full.kv.bytes_per_token == 32 * per_token_layer  # one token: the window does not matter


def test_qwen3_kv_bytes() -> None:
    p = plan(shipped("qwen3_moe"), seq_len=1000, tp=8, ep=8)
    assert p.kv.bytes_per_token == 94 * 2 * 4 * 128 * 2
    assert p.memory.kv_cache == 1000 * 94 * 2 * 1 * 128 * 2  # 4 KV heads over TP 8: one per rank


def test_mha_variant(tmp_path: Path) -> None:
    """Llama with as many KV heads as query heads: MHA, KV split over TP like the query heads."""
    mha = variant(
        "llama",
        tmp_path,
        lambda raw: raw.pop("architecture"),
        lambda cfg: cfg.update(num_key_value_heads=32),
    )
    p = plan(mha, tp=8, seq_len=100)
    assert p.arch.structure.attention.kind == "mha"
    assert (
        p.kv.bytes_per_token_layer == 2 * 32 * 128 * 2 and p.kv.rank_bytes_per_token_layer == 2 * 4 * 128 * 2
    )
    sim = run(mha, batch=8, context_len=100)
    assert "H4 KV4" in next(k.op.shapes for k in sim.kernels if k.op.name == "attention_decode")


@pytest.mark.parametrize(
    "name, kwargs, message",
    [
        ("llama", {"tp": 3}, "does not divide the 32 attention heads"),
        ("llama", {"ep": 2, "dp": 2}, "no routed experts"),
        ("qwen3_moe", {"tp": 8, "ep": 16}, "does not divide the 8 devices"),
        ("qwen3_moe", {"ep": 3, "dp": 3}, "does not divide the 128 routed experts"),
    ],
)
def test_bad_parallel_sizes(name: str, kwargs: dict, message: str) -> None:
    with pytest.raises(KadaptError, match=message):
        plan(shipped(name), **kwargs)


# --- plan: quantization globs --------------------------------------------------------------------------


def _quant(modules: str) -> Callable[[dict], None]:
    def edit(raw: dict) -> None:
        raw["quantization"] = [
            {
                "id": "Q1",
                "why": "test",
                "modules": modules,
                "bits": 4,
                "group_size": 128,
                "packed_dtype": "int32",
                "scale_dtype": "bfloat16",
            }
        ]

    return edit


def test_quantization_glob_matching_nothing_is_located(tmp_path: Path) -> None:
    bad = variant("llama", tmp_path, _quant("language_model.model.layers.*.mlp.experts.*"))
    with pytest.raises(KadaptError) as info:
        model_inputs(bad, None)
    message = str(info.value)
    assert (
        "quantization[0] (Q1) modules 'language_model.model.layers.*.mlp.experts.*' matches no parameter"
        in message
    )
    assert "model.layers." in message  # real names of this model
    assert info.value.location == bad.locate("quantization[0]")
    result = CliRunner().invoke(cli, ["plan", str(bad.path)])
    assert result.exit_code == 1 and "matches no parameter" in result.output


def _int4_config(ignore: list[str]) -> Callable[[dict], None]:
    """A compressed-tensors quantization_config storing every Linear but those ``ignore`` lists int4,
    group 128."""

    def edit(config: dict) -> None:
        weights = {"type": "int", "num_bits": 4, "group_size": 128, "strategy": "group", "symmetric": True}
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "pack-quantized",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
            "ignore": ignore,
        }

    return edit


def test_a_config_quantizing_some_layers_splits_the_group(tmp_path: Path) -> None:
    """The config stores only layers 10-19's MLP int4 (Q1 claims just that): one line per format."""
    others = ["lm_head", "re:.*self_attn.*", r"re:model\.layers\.([0-9]|[23][0-9])\.mlp\."]
    partial = variant("llama", tmp_path, _quant("model.layers.1?.mlp.*"), _int4_config(others))
    lines = [w for w in plan(partial).weights if w.group.name == "dense_mlp"]
    per_layer = 3 * 4096 * 14336
    assert {(w.format, w.params) for w in lines} == {("int4/g128", 10 * per_layer), ("bf16", 22 * per_layer)}
    assert {w.name for w in lines} == {"dense_mlp [int4/g128]", "dense_mlp [bf16]"}


# --- plan: the CLI ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", SHIPPED)
def test_cli_plan_every_family(name: str) -> None:
    spec = shipped(name)
    text = CliRunner().invoke(cli, ["plan", str(spec.path), "--device", "h200"])
    assert text.exit_code == 0, text.output
    structure = model_inputs(spec, None).arch.structure
    assert structure.describe() in text.output
    assert "None" not in text.output
    if not structure.attention.is_mla:
        assert "MLA" not in text.output and "latent" not in text.output
    if structure.moe is None:
        assert "MoE" not in text.output and "experts" not in text.output
    data = json.loads(CliRunner().invoke(cli, ["plan", str(spec.path), "--format", "json"]).output)
    assert data["kv_cache"]["layout"] == structure.attention.default_kv_layout
    assert data["weights"]["total_params"] == plan(spec).total_params


# --- simulate -----------------------------------------------------------------------------------------------


def test_attended_pairs() -> None:
    assert attended_pairs(0, 4, None) == 1 + 2 + 3 + 4
    assert attended_pairs(0, 8, 4) == 1 + 2 + 3 + 4 * 5
    assert attended_pairs(10, 2, None) == 11 + 12
    assert attended_pairs(10, 2, 4) == 8


# the scan a linear layer runs by mixer kind: (decode, prefill), as serving engines name the kernels
LINEAR_SCANS = {
    "gated_delta_net": ("fused_sigmoid_gating_delta_rule_update", "chunk_gated_delta_rule"),
    "kda": ("fused_recurrent_kda", "chunk_kda"),
    "mamba2": ("selective_state_update", "mamba_chunk_scan_combined"),
    "lightning": ("linear_decode_forward_triton", "lightning_attention"),
}


def attention_kernel(s: ModelStructure, decode: bool) -> str:
    """The kernel an attention layer of ``s`` runs: decode by its kind (DSA: FlashMLA's sparse kernel over
    the top-k); a prefill from an empty cache shorter than DSA's top-k runs dense (the fewer FLOPs)."""
    if not decode:
        return "flash_attention_prefill"
    if s.indexer is not None:
        return "sparse_mla_decode"
    return "mla_decode_attention" if s.attention.is_mla else "attention_decode"


@pytest.mark.parametrize("name", SHIPPED)
@pytest.mark.parametrize("decode", [True, False])
def test_simulate_every_family(name: str, decode: bool) -> None:
    spec = shipped(name)
    s = model_inputs(spec, None).arch.structure
    moe = s.moe is not None
    ep = 8 if moe else 1
    sim = (
        run(spec, tp=8, ep=ep, batch=16, context_len=2048)
        if decode
        else run(spec, tp=8, ep=ep, batch=2, query_len=1024, context_len=0, decode=False)
    )
    rows = sim.rows()
    # decode hides shared experts behind the routed path (priced 0, bound "overlapped")
    assert sim.step_time > 0 and all(r.time > 0 or r.bound == "overlapped" for r in rows)
    assert sum(r.time for r in rows) == pytest.approx(sim.step_time)
    names = {r.name for r in rows}
    if not s.attention.is_mla:
        assert not any("mla" in n for n in names)
    # a traced layer per kind: each attention layer runs its attention kernel, each linear layer its scan
    kinds = s.layer_kinds
    # full, sliding, chunked, indexed, and the KV-sharing layers (Gemma-4: they attend over another's cache)
    attending = len(s.attention_layer_ids) + len(s.shared_layer_ids)
    assert sum(r.count for r in rows if r.name == attention_kernel(s, decode)) == attending
    if s.linear is not None:  # each linear layer runs its mixer's scan (decode: the recurrent update)
        scan = LINEAR_SCANS[s.linear.kind][0 if decode else 1]
        assert sum(r.count for r in rows if r.name == scan) == len(s.linear_layer_ids)
    # one all-reduce per mixer and per MLP a layer has (Nemotron-H's blocks hold one or the other)
    sublayers = 2 * s.num_layers - kinds.count("none") - len(s.mlpless_layer_ids)
    assert sum(r.count for r in rows if r.name == "tp_all_reduce") == sublayers
    if moe:
        experts = sum(r.count for r in rows if r.name == "grouped_gemm(routed_experts)")  # over layer kinds
        assert experts == s.n_moe_layers
        assert not any(n.startswith("ep_") for n in names)  # EP 8 inside TP 8: no all-to-all
    else:
        assert not any("experts" in n or n.startswith("ep_") for n in names)
    assert sim.model == s.describe()


def test_llama_decode_attention_by_hand() -> None:
    """GQA decode at TP 8: 4 query heads over 1 KV head per rank, every query reads the whole cache."""
    sim = run(shipped("llama"), tp=8, batch=32, context_len=8192)
    b, heads, kv, dim, ctx = 32, 4, 1, 128, 8192 + 1
    pairs = b * heads * 1 * ctx
    attention = row(sim, "attention_decode")
    assert attention.count == 32 and attention.module == "dense_layer.self_attn"
    assert attention.flops == 32 * (2 * pairs * dim + 2 * pairs * dim)
    cache_read, q_and_out, cache_write = (
        b * ctx * kv * 2 * dim * 2,
        2 * b * heads * 2 * dim,
        b * kv * 2 * dim * 2,
    )
    assert attention.bytes == 32 * (cache_read + q_and_out + cache_write)
    qkv = next(r for r in sim.rows() if r.name == "mm(q_proj+k_proj+v_proj)")  # one merged GEMM
    assert qkv.module == "dense_layer.self_attn"
    assert qkv.flops == 32 * 2 * b * 4096 * (heads + 2 * kv) * dim  # the traced projections at per-rank width
    assert sim.memory.kv_cache == 32 * (8192 + 1) * 32 * kv * 2 * dim * 2


def test_gqa_tp16_replicates_kv_heads_in_the_trace() -> None:
    spec = shipped("llama")
    inputs = model_inputs(spec, None)
    dep = Deployment(Parallel(16, 1, 1), 16, 1, 1024, True)
    with applied(spec, backend="simulation"), torch.device("meta"):
        parts, notes = build_rank(spec, inputs, dep, Recorder())
    layer = parts.layer("dense")
    assert notes == [] and layer is not None
    attn = layer.self_attn
    assert attn.q_proj.weight.shape == (2 * 128, 4096) and attn.k_proj.weight.shape == (128, 4096)
    sim = run(spec, tp=16, batch=16, context_len=1024)
    assert "KV1" in next(k.op.shapes for k in sim.kernels if k.op.name == "attention_decode")


def test_mistral_attention_capped_at_the_window() -> None:
    spec = shipped("mistral")
    long, window = run(spec, tp=1, batch=4, context_len=20000), run(spec, tp=1, batch=4, context_len=4095)
    a_long, a_window = row(long, "attention_decode"), row(window, "attention_decode")
    pairs = 4 * 32 * 4096  # batch x heads x keys: 4096 of the 20001 / 4096 cached
    assert a_long.flops == a_window.flops == 32 * (2 * pairs * 128 + 2 * pairs * 128)  # QK^T + PV
    assert a_long.bytes == a_window.bytes
    assert long.memory.kv_cache == window.memory.kv_cache == 4 * 32 * 4096 * 2 * 8 * 128 * 2
    prefill = run(spec, tp=1, batch=1, query_len=8192, context_len=0, decode=False)
    pairs = 32 * (4096 * 4097 // 2 + 4096 * 4096)  # 32 heads; queries past 4096 see 4096 keys
    assert row(prefill, "flash_attention_prefill").flops == 32 * 2 * pairs * 256


def test_qwen3_traces_one_moe_layer() -> None:
    sim = run(shipped("qwen3_moe"), tp=8, ep=8, batch=32, context_len=4096)
    assert {r.scope for r in sim.rows()} == {"model", "moe"}  # no dense layer in the model
    experts = row(sim, "grouped_gemm(routed_experts)")
    pairs = 32 * 8 / 8  # tokens x top-8 over EP 8
    assert experts.flops == 94 * 2 * pairs * 3 * 4096 * 1536
    router = next(r for r in sim.rows() if r.module == "moe_layer.mlp.gate" and r.name == "mm")
    assert router.flops == 94 * 2 * 32 * 4096 * 128  # replicated router over all 128 experts
    assert row(sim, "attention_decode").flops == 94 * 2 * (32 * 8 * 4097) * 256  # 8 q heads, 1 KV head


def test_deepseek_fp8_checkpoint_dispatches_8bit_activations() -> None:
    spec = shipped("deepseek_v3")
    # attention DP 8 with EP 8: tokens travel by all-to-all
    fp8 = run(spec, tp=1, dp=8, ep=8, batch=64, context_len=4096)
    bf16 = run(spec, tp=1, dp=8, ep=8, batch=64, context_len=4096, quant="BF16")
    # (at 8 tokens per rank both are near DeepEP's per-call floor, dispatch's the higher one)
    assert row(fp8, "ep_dispatch(all_to_all)").time < row(bf16, "ep_dispatch(all_to_all)").time

    def row_bytes(sim: Simulation) -> dict[str, float]:
        return {
            k.op.name: k.op.comm["token_bytes"]
            for k in sim.kernels
            if k.op.comm and k.op.name.startswith("ep_")
        }

    # 1 B per element dispatched with 8-bit activations, 2 B otherwise; combine is bf16 either way
    assert row_bytes(fp8) == {"ep_dispatch(all_to_all)": 7168, "ep_combine(all_to_all)": 2 * 7168}
    assert row_bytes(bf16) == {"ep_dispatch(all_to_all)": 2 * 7168, "ep_combine(all_to_all)": 2 * 7168}
    assert fp8.memory.weights < 0.55 * bf16.memory.weights
    assert fp8.step_time < bf16.step_time
    assert row(fp8, "grouped_gemm(routed_experts)").count == 58 and row(fp8, "mm", "dense").count > 0


def test_cli_simulate_prints_the_structure() -> None:
    result = CliRunner().invoke(
        cli,
        ["simulate", str(shipped("llama").path), "--device", "h200", "--tp", "8", "--decode", "--batch", "8"],
    )
    assert result.exit_code == 0, result.output
    assert "model: 32 layers, hidden 4096, GQA 32 heads / 8 KV heads x 128, dense MLP 14336" in result.output
    assert "mla" not in result.output.lower() and "experts" not in result.output


# --- a family kadapt ships no spec for, from YAML alone --------------------------------------------------

MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "vocab_size": 32000,
    "max_position_embeddings": 32768,
    "sliding_window": None,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-05,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_mixtral_from_yaml_alone(tmp_path: Path) -> None:
    """No `moe` or `architecture` section: the structure comes from the config, the experts module is
    the one holding the stacked [8, ...] weights, attention is priced through the interface."""
    (tmp_path / "mixtral").mkdir()
    (tmp_path / "mixtral" / "config.json").write_text(json.dumps(MIXTRAL_CONFIG), encoding="utf-8")
    path = tmp_path / "mixtral.yaml"
    path.write_text(
        "apiVersion: kadapt/v1\nkind: AdapterSpec\nmetadata:\n  name: mixtral\ngate:\n  model_type: mixtral\n"
        "source:\n  config: mixtral/config.json\nmodule_paths:\n  language_model: model\n"
        "  language_layers: model.layers\n  lm_head: lm_head\n",
        encoding="utf-8",
    )
    spec = load_spec(path)
    p = plan(spec, tp=2, ep=2)
    assert p.total_params == 46_702_792_704  # Mixtral-8x7B's published 46.7B
    assert p.active_params == 12_879_925_248  # 2 of 8 experts: "12.9B active"
    assert "router_bias" not in {w.group.name for w in p.weights}  # softmax routing
    sim = run(spec, tp=2, ep=2, batch=8, context_len=1024)
    assert row(sim, "grouped_gemm(routed_experts)").count == 32
    assert row(sim, "attention_decode").count == 32
    assert "H16 KV4" in next(k.op.shapes for k in sim.kernels if k.op.name == "attention_decode")
