"""Kernel tables as a calibration experiment: every shipped table is a deterministic regeneration of
AIConfigurator's data (newest framework version per curve, recorded), each device prices with its own
measurements where they exist and says so where it borrows, and the serving framework reaches the
default cost model."""

from __future__ import annotations

import json
import math
import re

import pytest
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator
from kimi_adapter_core.backends.simulation.estimate.cost import kernel_table
from kimi_adapter_core.backends.simulation.estimate.simulator import Simulation, simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.tables import kernels
from kimi_adapter_core.backends.simulation.tables.curves import (
    Curve,
    Match,
    _matched,
    measured_across,
    measured_at,
)
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.backends.simulation.tables.kernels import KERNELS_DIR, load_kernels
from kimi_adapter_core.spec import load_spec

needs_aic = pytest.mark.skipif(not aiconfigurator.available(), reason="aiconfigurator-core not installed")
SYSTEM_TABLES = ("h100_sxm", "h200_sxm", "b200_sxm", "gb200")
FRAMEWORKS = ("trtllm", "sglang", "vllm")


def curves(table: dict) -> list[dict]:
    """Every curve of a table document (the dicts that carry a shape axis)."""
    out = []
    for value in table.values():
        if isinstance(value, dict):
            out += [value] if "source" in value and any(isinstance(v, list) for v in value.values()) else []
            out += curves(value)
    return out


def decode(spec: str, device: str, framework: str = "trtllm", tp: int = 8, ep: int = 8) -> Simulation:
    loaded = load_spec(REPO / "specs" / f"{spec}.yaml")
    dep = Deployment(Parallel(tp, 1, ep), 32, 1, 4096, True, kv_dtype="bf16")
    return simulate(model_inputs(loaded, None), loaded, dep, get_device(device), framework=framework)


def read_table(name: str) -> dict:
    """A shipped table as data, read as ``kernels`` reads it (libyaml where it is there: the tables run
    to thousands of lines, ~10x slower through the pure-Python loader)."""
    return kernels._read(name, KERNELS_DIR)


# --- the shipped tables -------------------------------------------------------------------------------
@needs_aic
def test_every_shipped_table_is_a_regeneration() -> None:
    from kimi_adapter_core.backends.simulation.tables import calibrate

    assert {f"{s}_{f}" for s, f in calibrate.shipped()} == {
        f"{s}_{f}" for s in SYSTEM_TABLES for f in FRAMEWORKS
    }
    for system, framework in calibrate.shipped():
        path = KERNELS_DIR / f"{system}_{framework}.yaml"
        assert path.read_text(encoding="utf-8") == calibrate.render(calibrate.calibrate(system, framework)), (
            path
        )


def test_every_curve_names_its_measurement() -> None:
    """Each curve says system/op/framework/version/file (kernel); the table's own framework first."""
    pattern = re.compile(r"^(?P<system>\w+)/\w+/(?P<framework>\w+)/(?P<version>[\w.]+)/\w+\.parquet \(.+\)")
    for system in SYSTEM_TABLES:
        for framework in FRAMEWORKS:
            data = read_table(f"{system}_{framework}")
            assert data["name"] == f"{system}_{framework}" and data["device"]
            found = [pattern.match(c["source"]) for c in curves(data)]
            assert len(found) >= 16 and all(found), data["name"]
            assert all(m["system"] == system for m in found if m)
            # most curves are the framework's own; the rest are kernels it never measured here
            own = sum(m["framework"] == framework for m in found if m)
            assert own > len(found) / 2, (data["name"], own, len(found))


@needs_aic
def test_curves_come_from_the_newest_version_that_measured_the_kernel() -> None:
    """The int4 Marlin curve was fitted to the SGLang version with the most rows (0.5.10), whose
    kernel is several times slower than the current one; every curve now names the newest version
    holding rows of its kernel, which is checked here against the folders on disk."""
    import pandas as pd
    from packaging.version import Version

    from kimi_adapter_core.backends.simulation.tables import calibrate_rows

    for system in SYSTEM_TABLES:
        root = calibrate_rows._tables(system)
        data = read_table(f"{system}_trtllm")
        source = data["grouped_gemm"]["w4a16"]["source"]
        framework, version = source.split("/")[2:4]
        measured = [
            p.parent.name
            for p in root.glob(f"moe/{framework}/*/moe_perf.parquet")
            if "int4_wo" in set(pd.read_parquet(p, columns=["moe_dtype"]).moe_dtype)
        ]
        assert Version(version) == max(map(Version, measured)), (system, source, measured)


def test_kimi_int4_experts_price_at_the_current_marlin_kernel() -> None:
    """A prefill-sized int4 expert GEMM: the 0.5.10 curve gave 0.05 of the bound at 64 pairs per
    expert; the current kernel reaches more than three times that."""
    table = load_kernels("h200_sxm_trtllm")
    assert table.grouped_eff("w4a16", 64)[0] > 3 * 0.05


# --- a shape the tables measured prices with its own rows ---------------------------------------------
# Kimi-K2.5's routed experts at EP8 in a TP8 layout (no attention DP: the layout the rows measured)
KIMI_EXPERTS = {"hidden": 7168, "width": 2048, "experts": 384, "top_k": 8, "ep": 8, "attention_dp": 1}


def test_a_measured_shape_takes_its_own_curve_and_others_the_median() -> None:
    """The curve at a shape the table measured is that shape's (its match names it); a shape no row
    has, a layout the rows were not measured in, or an op without the attributes, prices with the
    median over every shape."""
    table = load_kernels("h200_sxm_sglang")
    median = table.grouped["w4a16"]
    own = median.at(KIMI_EXPERTS)
    assert own is not median and own.xs != median.xs
    assert median.at(KIMI_EXPERTS | {"ep": 3}) is median and median.at(None) is median
    assert median.at(KIMI_EXPERTS | {"attention_dp": 8}) is median  # wide EP runs other kernels
    assert table.grouped_eff("w4a16", 128 * 8 / 384, KIMI_EXPERTS) == (own(128 * 8 / 384), own.overhead)
    mla = table.decode["mla"]
    kimi = {"heads": 8, "kv_dtype": "bf16", "attention_dp": 1}
    assert mla.at(kimi) is not mla.at(kimi | {"kv_dtype": "fp8"}) and mla.at(kimi) is not mla
    assert mla.at({"heads": 8, "attention_dp": 1}) is mla  # decode curves are per cache dtype too


@needs_aic
def test_kimi_int4_experts_reproduce_the_measured_marlin_row() -> None:
    """Kimi-K2.5's routed experts at EP8, 128 decode tokens, are a measured Marlin shape: priced with
    its own curve they reproduce the row (the median curve over other EP sizes priced them 1.4x)."""
    import pandas as pd

    from kimi_adapter_core.backends.simulation.tables import calibrate_rows

    rows = pd.read_parquet(calibrate_rows._tables("h200_sxm") / "moe/sglang/0.5.14/moe_perf.parquet")
    at = (
        rows[
            (rows.moe_dtype == "int4_wo")
            & (rows.num_experts == 384)
            & (rows.moe_ep_size == 8)
            & (rows.moe_tp_size == 1)
            & (rows.num_tokens == 128)
        ]
        .set_index("distribution")
        .latency
    )
    spec = load_spec(REPO / "specs" / "kimi_k25.yaml")
    dep = Deployment(Parallel(8, 1, 8), 128, 1, 4096, True, kv_dtype="bf16")
    sim = simulate(model_inputs(spec, None), spec, dep, get_device("h200"), framework="sglang")
    experts = next(k for k in sim.kernels if k.op.kind == "experts")
    assert experts.time * 1e3 == pytest.approx(float(at["power_law_1.01"]), rel=0.02)


@needs_aic
def test_a_power_law_row_below_the_pipeline_floor_is_reproduced() -> None:
    """At one token the measured rank may be routed few of the token's experts and skip most of the
    routed pipeline: B200 SGLang's DeepSeek-V3 experts at EP4 take 0.040 ms under power-law routing
    where balanced routing takes 0.073 and the shape's pipeline floor is 0.061. A factor on the time
    above the floor cannot go below the floor (priced 0.061: the TP4 decode b1 step 1.19x
    AIConfigurator); the recorded scale of the floor reaches the row."""
    import pandas as pd

    from kimi_adapter_core.backends.simulation.tables import calibrate_rows

    rows = pd.read_parquet(calibrate_rows._tables("b200_sxm") / "moe/sglang/0.5.14/moe_perf.parquet")
    keep = (rows.moe_dtype == "fp8_block") & (rows.hidden_size == 7168) & (rows.num_experts == 256)
    keep &= (rows.moe_ep_size == 4) & (rows.moe_tp_size == 1) & (rows.num_tokens == 1)
    (row,) = rows[keep & (rows.distribution == "power_law_1.01")].latency
    spec = load_spec(REPO / "specs" / "deepseek_v3.yaml")
    dep = Deployment(Parallel(4, 1, 4), 1, 1, 4096, True, kv_dtype="fp8")
    sim = simulate(model_inputs(spec, None), spec, dep, get_device("b200"), framework="sglang")
    experts = next(k for k in sim.kernels if k.op.kind == "experts")
    assert experts.time * 1e3 == pytest.approx(float(row), rel=0.03)
    assert (
        load_kernels("b200_sxm_sglang").imbalance_floor("fp8_block", 1 * 8 / 4 / 64, experts.op.attrs) < 0.7
    )


def test_mla_decode_at_8_heads_per_rank_reads_at_its_own_efficiency() -> None:
    """Kimi-K2.5 at TP8 runs MLA decode with 8 heads per rank, which streams a 604 MB latent cache at
    ~0.8 of HBM bandwidth; the median over 1-128 heads (0.58 there) priced it 1.4x too slow."""
    table = load_kernels("h200_sxm_sglang")
    read = 128 * 4097 * 576 * 2
    own = table.attention_eff(True, "mla", read, {"heads": 8, "kv_dtype": "bf16", "attention_dp": 1})
    assert own > 0.75 and own > 1.2 * table.attention_eff(True, "mla", read)


def _source_rows(source: str) -> object:
    """The measured rows a curve's ``source`` names (``<system>/<op>/<framework>/<version>/<file>
    (<kernel>)``), of that kernel only."""
    import pandas as pd

    from kimi_adapter_core.backends.simulation.tables import calibrate_rows

    path, kernel = re.match(r"^(\S+\.parquet) \(([^)]+)\)", source).groups()
    system, rest = path.split("/", 1)
    rows = pd.read_parquet(calibrate_rows._tables(system) / rest)
    return rows[rows.kernel_source == kernel]


def _qwen3_prefill_attention(tokens: int) -> object:
    """Qwen3-235B's attention op in a TP8 prefill of one ``tokens``-token sequence (8 query heads,
    1 KV head per rank)."""
    from kimi_adapter_core.backends.simulation.estimate.simulator import trace_kernels

    loaded = load_spec(REPO / "specs" / "qwen3_moe.yaml")
    dep = Deployment(Parallel(8, 1, 8), 1, tokens, 0, False, kv_dtype="bf16")
    ops, _ = trace_kernels(loaded, model_inputs(loaded, None), dep)
    return next(op for op in ops if op.kind == "attention")


@needs_aic
@pytest.mark.parametrize(
    ("device", "framework"), [("gb200", "trtllm"), ("b200", "trtllm"), ("b200", "sglang"), ("h200", "trtllm")]
)
@pytest.mark.parametrize("tokens", [1024, 4096])
def test_gqa_prefill_at_a_measured_batch_and_length_reproduces_its_row(
    device: str, framework: str, tokens: int
) -> None:
    """One 1,024-token sequence at 8 / 1 heads per rank is measured at 29 us on GB200 (TensorRT-LLM);
    the shape's curve over every batch (the median at each length, set by batches 2-256) priced it
    7 us. The shape's own batch prices it from its own rows, and the bound the efficiency is taken
    against is the op's own (once 1.8x its bytes: 20% under the row where it is bandwidth-bound)."""
    from kimi_adapter_core.backends.simulation.estimate.cost import price

    op = _qwen3_prefill_attention(tokens)
    hardware = get_device(device)
    table = kernel_table(hardware, framework)
    rows = _source_rows(read_table(table.name)["attention"]["prefill"]["gqa"]["source"])
    keep = (rows.num_heads == 8) & (rows.num_key_value_heads == 1) & (rows.head_dim == 128)
    keep &= (rows.attn_dtype == "bfloat16") & (rows.kv_cache_dtype == "bfloat16") & (rows.window_size == 0)
    (row,) = rows[keep & (rows.batch_size == 1) & (rows.isl == tokens)].latency
    assert price(op, hardware, table).time * 1e3 == pytest.approx(float(row), rel=0.02)


def test_a_prefill_batch_not_measured_prices_with_its_shape_over_every_batch() -> None:
    """Prefill shapes are fitted per batch first: a measured batch takes its own curve, a batch the
    table never measured the shape's curve over every batch; decode curves are keyed by the bytes
    read and take no batch."""
    table = load_kernels("gb200_trtllm")
    gqa = table.prefill["gqa"]
    shape = {"heads": 8, "kv_heads": 1, "attention_dp": 1}
    every_batch = gqa.at(shape)
    assert every_batch is not gqa and gqa.at(shape | {"batch": 1}) not in (gqa, every_batch)
    assert gqa.at(shape | {"batch": 3}) is every_batch  # three sequences: no row
    decode = table.decode["gqa"]
    assert decode.at(shape | {"kv_dtype": "bf16", "batch": 1}) is decode.at(shape | {"kv_dtype": "bf16"})


@needs_aic
@pytest.mark.parametrize(("device", "framework"), [("b200", "sglang"), ("h200", "trtllm")])
def test_the_tp_all_reduce_reproduces_each_measured_message_size(device: str, framework: str) -> None:
    """The custom all-reduce changes algorithm between 16 and 32 MiB (B200, SGLang: 57 us, then 170
    us): binned to a 4x grid, the 32 MiB all-reduce of a 4,096-token prefill at hidden 4,096 priced
    135 us. The curve is kept at every measured size, so each row is reproduced."""
    from kimi_adapter_core.backends.simulation.estimate.cost import comm_time

    hardware = get_device(device)
    table = kernel_table(hardware, framework)
    rows = _source_rows(read_table(table.name)["all_reduce"]["source"])
    rows = rows[(rows.allreduce_dtype == "bfloat16") & (rows.num_gpus == 8)]
    for elements in (2**21, 2**22, 2**23, 2**24, 2**25):  # bf16 elements: 4-64 MiB
        row = float(rows[rows.message_size == elements].latency.median())
        comm = {"collective": "all_reduce", "bytes": 2 * elements, "group": 8}
        assert comm_time(hardware, comm, table)[0] * 1e3 == pytest.approx(row, rel=0.01), elements


# --- vLLM's MLA, measured only as a module -------------------------------------------------------------
def _module_row(
    phase: str, heads: int, kv: str, gemm: str, batch: int, at: int, system: str = "h200_sxm"
) -> float:
    """ms of vLLM 0.24's MLA module on ``system`` (DeepSeek-V3's rows) at ``at`` keys (decode) or new
    tokens."""
    import pandas as pd

    from kimi_adapter_core.backends.simulation.tables import calibrate_mla_module, calibrate_rows

    rows = pd.read_parquet(
        calibrate_rows._tables(system) / f"mla/vllm/0.24.0/mla_{phase}_module_perf.parquet"
    )
    rows = rows[(rows.model == calibrate_mla_module.MLA_MODULE_MODEL) & (rows.tp_size == 1)]
    keep = (rows.num_heads == heads) & (rows.kv_cache_dtype == kv) & (rows.gemm_type == gemm)
    keep &= (rows.batch_size == batch) & (rows.mla_dtype == "bfloat16")
    keep &= (rows.step == at) if phase == "generation" else (rows.isl == at) & (rows.step == 0)
    (latency,) = rows[keep].latency
    return float(latency)


def _module_ms(sim: Simulation) -> tuple[float, list]:
    """ms of the MoE layer's MLA module as kadapt prices it (every kernel of its self_attn), and them."""
    core = next(k for k in sim.kernels if k.op.kind == "attention" and "moe" in k.op.scope)
    inside = [k for k in sim.kernels if k.op.scope == core.op.scope and ".self_attn" in k.op.module + "."]
    return sum(k.time for k in inside) * 1e3, inside


@needs_aic
@pytest.mark.parametrize(
    ("spec", "kv", "gemm", "tp"),
    [
        ("deepseek_v3", "fp8", "fp8_block", 8),
        ("kimi_k25", "bfloat16", "bfloat16", 8),
        ("kimi_k25", "bfloat16", "bfloat16", 4),
    ],
)
def test_vllm_mla_decode_is_the_measured_module(spec: str, kv: str, gemm: str, tp: int) -> None:
    """vLLM measured no standalone MLA kernel, only its whole attention module: at a measured shape
    (b128, 4k keys) kadapt's MLA decode - the attention curve taken out of the module plus the
    module's floor, every other kernel inside it folded in - is the module row; TensorRT-LLM's
    borrowed curve with vLLM's standalone GEMM rows priced DeepSeek-V3's 2.2x and Kimi-K2.5's 0.6x."""
    loaded = load_spec(REPO / "specs" / f"{spec}.yaml")
    dep = Deployment(Parallel(tp, 1, tp), 128, 1, 4096, True, kv_dtype="bf16" if kv == "bfloat16" else kv)
    sim = simulate(model_inputs(loaded, None), loaded, dep, get_device("h200"), framework="vllm")
    heads = {"deepseek_v3": 128, "kimi_k25": 64}[spec] // tp
    ms, inside = _module_ms(sim)
    assert ms == pytest.approx(_module_row("generation", heads, kv, gemm, 128, 4096), rel=0.03)
    assert {k.bound for k in inside if k.op.kind != "attention"} == {"in_module"}
    core = next(k for k in inside if k.op.kind == "attention")
    assert core.bound == "module" and core.source == "table:h200_sxm_vllm (module)"


@needs_aic
@pytest.mark.parametrize(
    ("spec", "gemm", "tp", "system", "tokens"),
    [
        ("kimi_k25", "bfloat16", 8, "h200_sxm", 4096),
        ("deepseek_v3", "fp8_block", 8, "h200_sxm", 4096),
        ("deepseek_v3", "fp8_block", 8, "gb200", 1024),
        ("deepseek_v3", "fp8_block", 4, "b200_sxm", 4096),
    ],
)
def test_vllm_mla_prefill_is_the_measured_module(
    spec: str, gemm: str, tp: int, system: str, tokens: int
) -> None:
    """In prefill too the module is priced as measured: the attention curve (the bf16-projection rows
    less their GEMMs) plus the module's floor at its new tokens, every other kernel inside it folded
    in, is the module row (Kimi-K2.5, 8 heads per rank, 1 x 4,096 tokens on H200: 0.52 ms, of which
    TensorRT-LLM's borrowed attention curve gave 0.09). DeepSeek-V3's fp8-block projections on GB200
    at 1,024 tokens: 0.18 ms, where the standalone fp8-block GEMM rows (0.27-0.32 ms a call) priced
    the module's GEMMs at 1.5 ms."""
    loaded = load_spec(REPO / "specs" / f"{spec}.yaml")
    dep = Deployment(Parallel(tp, 1, tp), 1, tokens, 0, False, kv_dtype="bf16")
    device = get_device(calibrate_systems()[system])
    sim = simulate(model_inputs(loaded, None), loaded, dep, device, framework="vllm")
    heads = {"deepseek_v3": 128, "kimi_k25": 64}[spec] // tp
    ms, inside = _module_ms(sim)
    assert ms == pytest.approx(_module_row("context", heads, "bfloat16", gemm, 1, tokens, system), rel=0.05)
    assert {k.bound for k in inside if k.op.kind != "attention"} == {"in_module"}
    assert next(k for k in inside if k.op.kind == "attention").bound == "module"


def calibrate_systems() -> dict[str, str]:
    from kimi_adapter_core.backends.simulation.tables import calibrate

    return calibrate.SYSTEMS


def test_a_module_floor_prices_only_the_shape_it_measured() -> None:
    """The floor is matched on the module's shape - heads, cache dtype, the projections' kernel family
    (read off the kernels inside it) and the model width vLLM measured (DeepSeek-V3's 7168): another
    width, or a framework that measured a standalone MLA kernel (in a layout off its wide-EP path),
    keeps every kernel as priced."""
    from kimi_adapter_core.backends.simulation.estimate.cost import fold_modules, price
    from kimi_adapter_core.backends.simulation.estimate.simulator import trace_kernels

    loaded = load_spec(REPO / "specs" / "kimi_k25.yaml")
    dep = Deployment(Parallel(8, 1, 8), 32, 1, 4096, True, kv_dtype="bf16")
    ops, _ = trace_kernels(loaded, model_inputs(loaded, None), dep)
    h200 = get_device("h200")
    vllm = kernel_table(h200, "vllm")
    floor = vllm.floor_at(
        "mla", {"heads": 8, "kv_dtype": "bf16", "projections": "bf16", "hidden": 7168, "attention_dp": 1}
    )
    assert floor is not None and 80e-6 < floor(32) < 120e-6  # seconds: ~0.1 ms at 32 tokens
    priced = [price(op, h200, vllm) for op in ops]
    assert any(k.bound == "module" for k in fold_modules(priced))
    for op in ops:
        if op.kind == "attention":
            op.attrs["hidden"] = 2048
    assert fold_modules(priced) == priced
    assert not kernel_table(h200, "trtllm").module_floor
    # SGLang measured a standalone MLA kernel; its module floors are those of its wide-EP path only
    sglang = kernel_table(h200, "sglang")
    assert set(sglang.module_floor) == {"wide_ep_generation_mla", "wide_ep_context_mla"}
    on_sglang = [price(op, h200, sglang) for op in ops]
    assert fold_modules(on_sglang) == on_sglang


# --- devices price with their own measurements ----------------------------------------------------------
def test_blackwell_profiles_are_cited_and_have_their_own_tables() -> None:
    for name, tables, bandwidth in (("b200", "b200_sxm", 7.7e12), ("gb200", "gb200", 8e12)):
        device = get_device(name)
        assert device.kernels == tables and device.hbm_bandwidth == bandwidth
        assert device.peak("fp8") == 2 * device.peak("bf16")
        text = device.path.read_text(encoding="utf-8")
        assert "datasheet" in text and "nvidia.com" in text
        for framework in FRAMEWORKS:
            assert kernel_table(device, framework).measured_on("gemm") == name
    assert get_device("gb200").link_for(72).name.startswith("nvlink")  # one NVLink domain per rack


def test_h100_uses_its_own_curves_and_h800_says_it_borrows() -> None:
    h100 = decode("deepseek_v3", "h100")
    sources = {k.source for k in h100.kernels if k.op.kind in ("matmul", "experts", "attention")}
    assert sources == {"table:h100_sxm_trtllm"}
    h800 = decode("deepseek_v3", "h800")
    sources = {k.source for k in h800.kernels if k.op.kind in ("matmul", "experts", "attention")}
    assert sources == {"table:h200_sxm_trtllm (borrowed: h200 curves)"}
    # decode attention is latency-bound on small reads: H100's own curve is not H200's rescaled
    rescaled = kernel_table(get_device("h200")).decode["mla"]
    own = kernel_table(get_device("h100")).decode["mla"]
    assert own != rescaled


# --- the framework reaches the default cost model ---------------------------------------------------
def test_framework_changes_the_default_estimate_where_kernels_differ() -> None:
    trtllm, sglang = (decode("qwen3_moe", "h200", framework) for framework in ("trtllm", "sglang"))
    assert trtllm.cost_model == sglang.cost_model == "roofline"
    assert sglang.step_time != trtllm.step_time
    moe = [next(k for k in s.kernels if k.op.kind == "experts") for s in (trtllm, sglang)]
    assert moe[0].source == "table:h200_sxm_trtllm" and moe[1].source == "table:h200_sxm_sglang"
    assert moe[0].time != moe[1].time
    # a device whose tables do not depend on the framework prices every framework alike
    atlas = get_device("atlas_800_a3")
    assert kernel_table(atlas, "sglang") is kernel_table(atlas, "trtllm")


def test_cli_framework_reaches_the_roofline() -> None:
    from click.testing import CliRunner

    from kimi_adapter_core.cli import cli

    args = ["simulate", str(REPO / "specs" / "qwen3_moe.yaml"), "--device", "h200", "--tp", "8", "--ep", "8"]
    args += ["--decode", "--batch", "32", "--context-len", "4096", "--format", "json"]
    out = {}
    for framework in ("trtllm", "vllm"):
        result = CliRunner().invoke(cli, [*args, "--framework", framework])
        assert result.exit_code == 0, result.output
        out[framework] = json.loads(result.output)
    assert set(out["vllm"]["cost_model"]["sources"]) >= {"table:h200_sxm_vllm"}
    assert "table:h200_sxm_vllm" not in out["trtllm"]["cost_model"]["sources"]


# --- the held-out experiment (benchmarks/held_out.py [HELD-OUT]) ---------------------------------------
@pytest.fixture(scope="module")
def bench():
    """The held-out benchmark module, whose row filters, sources and splits define the experiment."""
    import importlib.util
    import sys

    path = REPO / "benchmarks" / "held_out.py"
    loaded = importlib.util.spec_from_file_location("held_out", path)
    assert loaded is not None and loaded.loader is not None
    module = importlib.util.module_from_spec(loaded)
    sys.modules.setdefault("held_out", module)
    loaded.loader.exec_module(module)
    return module


def test_the_test_split_shares_no_device_width_attention_kind_or_ep_size_with_development(bench) -> None:
    """Rules are chosen on the development split; the test split must be other devices, other model
    shapes and other layouts, or its score is not a test of how the rules carry over."""
    dev, test = bench.DEVELOPMENT, bench.TEST
    assert not set(dev.devices) & set(test.devices)
    assert not set(dev.families) & set(test.families)
    assert not set(dev.layouts) & set(test.layouts)
    families = {f.spec: f for f in bench.FAMILIES}
    widths = [{families[name].hidden for name in split.families} for split in (dev, test)]
    assert not widths[0] & widths[1]
    eps = [{ep for _, ep in split.layouts} for split in (dev, test)]
    assert not eps[0] & eps[1]
    mla = [{bool(load_spec(REPO / "specs" / f"{name}.yaml").mla) for name in s.families} for s in (dev, test)]
    assert mla == [{True}, {False}]  # MLA attention is developed on, GQA tested
    # every split is non-empty on the grid the bench prices, and a cell is in one split at most
    seen = {
        bench.split_of(s, f.spec, lay) for s, _ in bench.TARGETS for f in bench.FAMILIES for lay in f.layouts
    }
    assert seen == set(bench.SPLITS)
    assert bench.split_of("h200_sxm", "deepseek_v3", (8, 8)) == "development"
    assert bench.split_of("h100_sxm", "llama", (1, 1)) == "test"
    assert bench.split_of("h100_sxm", "deepseek_v3", (8, 8)) == "crossed"


def _experts(version: str, kernel: str) -> dict:
    return {"source": f"h200_sxm/moe/sglang/{version}/moe_perf.parquet ({kernel}), balanced; the curve..."}


def test_a_refit_case_without_any_row_of_its_kernel_is_not_scorable(bench) -> None:
    """A refit that kept no row of the measurement (framework, version, kernel) pricing an op prices
    it from another kernel: Kimi-K2.5's int4 experts, measured by the newest SGLang at its width only,
    from SGLang 0.5.10's ~4.7x slower Marlin. Such a case is counted apart, with the kernel named."""
    from kimi_adapter_core.backends.simulation.model.tracer import Op

    experts = Op(
        "experts", "mlp.experts", "layer", 1, "experts", 1e12, 1e9, "int4", attrs={"kernel": "w4a16"}
    )
    norm = Op("norm", "norm", "layer", 1, "vector", 1e6, 1e6)
    shipped = {"grouped_gemm": {"w4a16": _experts("0.5.14", "sglang_marlin_moe")}}
    older = {"grouped_gemm": {"w4a16": _experts("0.5.10", "sglang_marlin_moe")}}
    other_dtype = {"grouped_gemm": {"bf16": _experts("0.5.14", "sglang_fused_moe_triton")}}
    gone = "experts w4a16: no sglang 0.5.14 sglang_marlin_moe row left"
    assert (
        bench.unscorable(shipped, older, [norm, experts])
        == f"{gone} (sglang 0.5.10 sglang_marlin_moe instead)"
    )
    assert (
        bench.unscorable(shipped, other_dtype, [experts])
        == f"{gone} (sglang 0.5.14 sglang_fused_moe_triton instead)"
    )
    assert bench.unscorable(shipped, {}, [experts]) == f"{gone} (no curve (the roofline) instead)"
    assert bench.unscorable(shipped, shipped, [norm, experts]) is None
    assert bench.unscorable(other_dtype, other_dtype, [experts]) is None  # w4a16 falls back as priced
    tally = bench.Tally()
    for ratio, reason in ((1.05, None), (1.2, None), (1.5, None), (3.7, gone)):
        tally.add(ratio, reason)
    assert tally.record() == {"scorable": 3, "within_15": 1, "outside_35": 1, "not_scorable": {gone: 1}}


def test_the_test_split_is_recorded_once_per_rules_fingerprint(bench, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(bench, "LEDGER", tmp_path / "ledger.json")
    scores = {"shapes": bench.Tally().record()}
    assert bench.record_test("aaaa", scores) is None
    first = json.loads((tmp_path / "ledger.json").read_text())
    assert [entry["rules"] for entry in first] == ["aaaa"]
    assert bench.record_test("aaaa", {"shapes": {"scorable": 9}}) == first[0]  # a rerun is not recorded
    assert bench.record_test("bbbb", scores) is None
    assert [e["rules"] for e in json.loads((tmp_path / "ledger.json").read_text())] == ["aaaa", "bbbb"]
    fingerprint = bench.rules_fingerprint()
    assert len(fingerprint) == 16 and fingerprint == bench.rules_fingerprint()
    assert all(any(REPO.glob(pattern)) for pattern in bench.RULES)


def _family(bench, spec: str):
    return next(f for f in bench.FAMILIES if f.spec == spec)


def _shape_matches(table: dict) -> list[dict]:
    """Every ``match`` of every per-shape curve and module floor of a table document."""
    found = [s["match"] for c in curves(table) for s in c.get("shapes", [])]
    return found + [s["match"] for s in table.get("module_floor", {}).get("mla", {}).get("shapes", [])]


@needs_aic
def test_held_out_filters_drop_what_they_claim_and_keep_the_rest(bench) -> None:
    import pandas as pd

    from kimi_adapter_core.backends.simulation.tables import calibrate_rows

    root = calibrate_rows._tables("h200_sxm")
    deepseek = _family(bench, "deepseek_v3")
    moe = pd.read_parquet(root / "moe/sglang/0.5.14/moe_perf.parquet")
    gemm = pd.read_parquet(root / "gemm/sglang/0.5.14/gemm_perf.parquet")
    mla = pd.read_parquet(root / "mla/sglang/0.5.14/generation_mla_perf.parquet")
    module = pd.read_parquet(root / "mla/vllm/0.24.0/mla_generation_module_perf.parquet")
    shapes = bench.without_shapes(deepseek)
    kept = shapes("moe", moe), shapes("gemm", gemm), shapes("mla", mla), shapes("mla", module)
    assert not (kept[0].hidden_size == 7168).any() and (moe.hidden_size == 7168).any()
    assert not ((kept[1].n == 7168) | (kept[1].k == 7168)).any() and (gemm.n == 7168).any()
    for rows in kept[2:]:  # 128 heads at TP8 and TP4: 16 and 32 per rank
        assert not rows.num_heads.isin([16, 32]).any()
    assert all(len(rows) for rows in kept)  # the rest of every table is still fitted on
    assert len(kept[2]) == (~mla.num_heads.isin([16, 32])).sum()
    layout = bench.without_layout(deepseek, 8, 8)
    kept = layout("moe", moe), layout("gemm", gemm), layout("mla", mla), layout("attention", module)
    assert not (kept[0].moe_ep_size == 8).any() and (kept[0].hidden_size == 7168).any()  # other EPs stay
    assert len(kept[1]) == len(gemm)
    assert not (kept[2].num_heads == 16).any() and (kept[2].num_heads == 32).any()
    assert not (kept[3].num_heads == 16).any()


@needs_aic
@pytest.mark.parametrize(("kind", "framework"), [("shapes", "sglang"), ("layout", "vllm")])
def test_a_held_out_table_never_saw_the_scored_rows(bench, kind: str, framework: str) -> None:
    """The refit has no curve of the scored family's shapes or layout: every per-shape curve and
    module floor it keeps is at another width, EP size or head count (they price the scored ones
    from those around them), so it prices the scored steps otherwise than the shipped table, which
    measured them."""
    from kimi_adapter_core.backends.simulation.estimate.cost import price
    from kimi_adapter_core.backends.simulation.estimate.simulator import finish_step, trace_kernels
    from kimi_adapter_core.backends.simulation.tables import calibrate

    deepseek = _family(bench, "deepseek_v3")
    keep = bench.without_shapes(deepseek) if kind == "shapes" else bench.without_layout(deepseek, 8, 8)
    fit = calibrate.calibrate("h200_sxm", framework, keep)
    scored = (16, 32) if kind == "shapes" else (16,)
    matches = _shape_matches(fit)
    for match in matches:
        # SGLang's wide-EP MLA module was measured on DeepSeek-V3 alone (its width, 7168): its curves
        # and floors price only a wide-EP layout (``graph``), which no held-out case runs
        if kind != "shapes" or "graph" not in match:
            assert match.get("hidden") != 7168 if kind == "shapes" else match.get("ep") != 8, match
        assert match.get("heads") not in scored, match
    floors = {"vllm": {"mla", "mla_prefill"}, "sglang": {"wide_ep_generation_mla", "wide_ep_context_mla"}}
    assert set(fit.get("module_floor", ())) == floors[framework]
    assert any("heads" in match for match in matches)  # the other head counts' curves are kept
    spec = load_spec(REPO / "specs" / "deepseek_v3.yaml")
    device = get_device("h200")
    table, shipped = bench._table(fit, kind), kernel_table(device, framework)
    for decode_step in (True, False):
        dep = Deployment(
            Parallel(8, 1, 8), 32 if decode_step else 1, 1 if decode_step else 4096, 4096, decode_step
        )
        ops = trace_kernels(spec, model_inputs(spec, None), dep)[0]
        steps = [
            sum(k.total for k in finish_step([price(op, device, t) for op in ops], dep))
            for t in (table, shipped)
        ]
        assert steps[0] != steps[1]


def test_a_device_held_out_table_was_measured_on_another_device(bench) -> None:
    from kimi_adapter_core.backends.simulation.tables import calibrate

    assert set(bench.TARGETS) == set(calibrate.shipped())
    for sources in (bench.SAME_GENERATION, bench.OTHER_GENERATION):
        for system, source in sources.items():
            assert source != system
            for framework in FRAMEWORKS:
                table = bench.source_table(source, framework)
                assert table.name == f"{source}_{framework}"
                assert table.device == calibrate.SYSTEMS[source] != calibrate.SYSTEMS[system]
    hopper, blackwell = {"h100_sxm", "h200_sxm"}, {"b200_sxm", "gb200"}
    for system, source in bench.SAME_GENERATION.items():
        assert {system, source} <= hopper or {system, source} <= blackwell
    for system, source in bench.OTHER_GENERATION.items():
        assert (system in hopper) != (source in hopper)


def _gemm_row(system: str, m: int, n: int, k: int) -> float:
    """ms of vLLM 0.24's fp8-block GEMM row at (m, n, k) on ``system`` (whichever kernel served it)."""
    import pandas as pd

    from kimi_adapter_core.backends.simulation.tables import calibrate_rows

    rows = pd.read_parquet(calibrate_rows._tables(system) / "gemm/vllm/0.24.0/gemm_perf.parquet")
    (latency,) = rows[
        (rows.gemm_dtype == "fp8_block") & (rows.m == m) & (rows.n == n) & (rows.k == k)
    ].latency
    return float(latency)


@needs_aic
@pytest.mark.parametrize(
    ("system", "m"), [("b200_sxm", 1), ("gb200", 1), ("gb200", 1024), ("h200_sxm", 1), ("h200_sxm", 128)]
)
def test_a_gemm_prices_its_measured_call_floor(system: str, m: int) -> None:
    """vLLM 0.24's fp8-block GEMM rows are a fixed cost per call whatever the shape (DeepGEMM: 0.18 ms
    on B200, 0.30 on GB200, 0.27 / 0.53 at M = 1; on Hopper FlashInfer serves M <= 17 at 58 us and
    DeepGEMM the rest at 85 us): the table's ``gemm_floor`` prices it, with the efficiencies net of
    it. DeepSeek-V3's shared-expert gate/up GEMM (N 512 at TP8, K 7,168) reproduces its row within
    20% (GB200's rows scatter 0.27-0.32 ms by shape at one M; the floor is their median), where the
    efficiency alone priced a 1-token call on GB200 at 0.24 ms (row 0.50, now 0.54) and a 1,024-token
    one at 0.38 (row 0.27, now 0.31)."""
    from kimi_adapter_core.backends.simulation.estimate.cost import price
    from kimi_adapter_core.backends.simulation.model.tracer import Op
    from kimi_adapter_core.backends.simulation.tables import calibrate

    n, k = 512, 7168
    op = Op(
        "mm", "mlp.shared_experts", "moe", 1, "matmul", 2.0 * m * n * k, 2.0 * m * k + n * k + 2.0 * m * n,
        "fp8", attrs={"kernel": "fp8_block", "m": m},
    )  # fmt: skip
    device = get_device(calibrate.SYSTEMS[system])
    table = kernel_table(device, "vllm")
    assert table.gemm_fixed("fp8_block", m) > 0.05e-3  # the call's floor, not the 2 us op overhead
    assert price(op, device, table).time * 1e3 == pytest.approx(_gemm_row(system, m, n, k), rel=0.2)
    trtllm = kernel_table(device, "trtllm")  # a kernel without such a floor keeps a few us
    assert trtllm.gemm_fixed("fp8_block", m) < 0.015e-3


@needs_aic
def test_an_unmeasured_decode_shape_prices_with_its_cache_dtype_curves() -> None:
    """SGLang's MLA decode with an FP8 cache is ~6.7x slower than with a bf16 one (H200, b128 x 4k:
    1.04 vs 0.156 ms, flat in heads): after the exact shapes, the decode curve carries one curve per
    cache dtype (match: kv_dtype alone), the median over every head count of that dtype, and an
    unmeasured head count prices at its cache dtype's speed - from the head counts of that dtype
    around it, not the median over both."""
    import pandas as pd

    from kimi_adapter_core.backends.simulation.tables import (
        calibrate_attention,
        calibrate_fit,
        calibrate_rows,
    )

    table = kernel_table(get_device("h200"), "sglang")
    shapes = load_kernels("h200_sxm_sglang").decode["mla"].shapes
    fallbacks = [
        (dict(match), curve) for match, curve in shapes if dict(match).keys() == {"kv_dtype", "attention_dp"}
    ]
    assert sorted(m["kv_dtype"] for m, _ in fallbacks) == ["bf16", "fp8"]
    # after every exact shape: an exact shape still prices with its own curve
    assert all(len(dict(match)) > 2 for match, _ in shapes[: len(shapes) - len(fallbacks)])
    rows = pd.read_parquet(
        calibrate_rows._tables("h200_sxm") / "mla/sglang/0.5.14/generation_mla_perf.parquet"
    )
    rows = calibrate_attention._kv_read(
        rows[rows.mla_dtype == "bfloat16"].assign(ctx=lambda t: t.isl + t.step)
    )
    peak, bw = dict(get_device("h200").peak_flops), get_device("h200").hbm_bandwidth
    for match, curve in fallbacks:
        dtype = {"bf16": "bfloat16", "fp8": "fp8"}[match["kv_dtype"]]
        kernel = rows.kernel_source.value_counts().index[0]
        own = calibrate_fit._eff(
            rows[(rows.kv_cache_dtype == dtype) & (rows.kernel_source == kernel)],
            lambda f: calibrate_attention._mla_decode_ms(f, peak, bw),
        )
        assert list(curve.ys) == calibrate_fit._median_curve(own, "read", calibrate_fit.BYTES_GRID)
    unmeasured = {"heads": 12, "attention_dp": 1}  # no head count of 12 was measured: 8 and 16 were
    fp8 = table.attention_eff(True, "mla", 2**28, unmeasured | {"kv_dtype": "fp8"})
    bf16 = table.attention_eff(True, "mla", 2**28, unmeasured | {"kv_dtype": "bf16"})
    assert fp8 is not None and bf16 is not None and fp8 < bf16 / 2
    for kv, eff in (("fp8", fp8), ("bf16", bf16)):
        around = [
            table.attention_eff(True, "mla", 2**28, {"heads": h, "attention_dp": 1, "kv_dtype": kv})
            for h in (8, 16)
        ]
        assert min(around) <= eff <= max(around)
    assert table.attention_eff(True, "mla", 2**28, {"heads": 12}) == table.decode["mla"](2**28)  # DP: median


def test_an_unmeasured_head_count_takes_the_module_floor_around_it() -> None:
    """vLLM's MLA module floor grows with the heads (q_b and o_proj are per head); a head count not
    measured takes the two measured around it, linear in log(heads), every other attribute equal;
    past the measured range the nearest one's; a shape no floor matches otherwise keeps none."""
    from kimi_adapter_core.backends.simulation.estimate.cost import module_floor

    floors = load_kernels("b200_sxm_vllm").module_floor["mla"]
    shape = {"kv_dtype": "fp8", "projections": "fp8_block", "attention_dp": 1, "hidden": 7168}
    own = {h: module_floor(floors, shape | {"heads": h}) for h in (8, 16, 32, 64, 128)}
    assert all(own.values())
    held = {key: value for key, value in floors if dict(key)["heads"] not in (16, 32)}
    held = tuple(held.items())
    for heads, t in ((16, 1 / 3), (32, 2 / 3)):  # between 8 and 64: log2 steps 1/3 and 2/3 of the way
        got = module_floor(held, shape | {"heads": heads})
        assert got is not None
        for tokens in (1, 32, 128):
            expected = own[8](tokens) + t * (own[64](tokens) - own[8](tokens))
            assert got(tokens) == pytest.approx(expected, rel=1e-9)
            assert own[8](tokens) < got(tokens) < own[64](tokens)
    assert module_floor(floors, shape | {"heads": 256})(1) == own[128](1)  # past the end: the nearest
    assert module_floor(floors, shape | {"heads": 16, "hidden": 4096}) is None  # another width: none
    assert module_floor(floors, shape | {"heads": 16, "projections": "mixed"}) is None


def test_measured_across_takes_the_first_curve_per_value_and_the_keyless_curves_last() -> None:
    """Across a key, the first curve matching at each value counts (a prefill shape's curve at the
    op's batch before the shape over every batch, as ``measured_at`` orders them), and a curve whose
    match does not name the key (a decode curve per cache dtype) prices only where no value around
    the op's was measured."""

    def flat(y: float) -> Curve:
        return Curve((1.0, 100.0), (y, y))

    def match(**attrs) -> Match:
        return tuple(sorted((k, _matched(v)) for k, v in attrs.items()))

    prefill = (
        (match(heads=4, batch=1), flat(0.1)),
        (match(heads=16, batch=1), flat(0.3)),
        (match(heads=4), flat(0.5)),
        (match(heads=16), flat(0.7)),
    )
    got = measured_across(prefill, {"heads": 8, "batch": 1}, "heads")
    assert got is not None and got(10) == pytest.approx(0.2)  # halfway in log2 between 4 and 16, batch 1
    got = measured_across(prefill, {"heads": 8, "batch": 2}, "heads")
    assert got is not None and got(10) == pytest.approx(0.6)  # a batch not measured: over every batch
    decode = (
        (match(heads=4, kv_dtype="fp8"), flat(0.1)),
        (match(heads=16, kv_dtype="fp8"), flat(0.3)),
        (match(kv_dtype="fp8"), flat(0.9)),
        (match(kv_dtype="bf16"), flat(0.8)),
    )
    got = measured_across(decode, {"heads": 8, "kv_dtype": "fp8"}, "heads")
    assert got is not None and got(10) == pytest.approx(0.2)  # the neighbours, not the dtype's median
    got = measured_across(decode, {"heads": 8, "kv_dtype": "bf16"}, "heads")
    assert got is not None and got(10) == pytest.approx(0.8)  # no neighbour of that dtype: its median
    assert measured_across(decode, {"heads": 8}, "heads") is None


def _without_heads(curve: Curve, heads: int) -> Curve:
    """``curve`` as a table fitted without any row at ``heads`` per rank would hold it."""
    from dataclasses import replace

    return replace(curve, shapes=tuple((m, c) for m, c in curve.shapes if dict(m).get("heads") != heads))


@pytest.mark.parametrize(
    ("name", "decode", "kind", "key", "shape", "around"),
    [  # Qwen3-235B TP8 prefill (8 query / 1 KV head per rank), one 1,024-token sequence
        ("b200_sxm_sglang", False, "gqa", 1024.0, {"heads": 8, "kv_heads": 1, "batch": 1}, (6, 12)),
        ("gb200_trtllm", False, "gqa", 1024.0, {"heads": 8, "kv_heads": 1, "batch": 1}, (6, 12)),
        # DeepSeek-V3 TP8 decode (16 heads per rank), FP8 cache, b1 x 4k: 2.4 MB read
        ("h200_sxm_sglang", True, "mla", 4096 * 576.0, {"heads": 16, "kv_dtype": "fp8"}, (8, 32)),
    ],
)
def test_an_attention_head_count_not_measured_prices_from_the_head_counts_around_it(
    name: str, decode: bool, kind: str, key: float, shape: dict, around: tuple[int, int]
) -> None:
    """Held out (no curve at its head count), an attention op takes the curves at the two measured
    head counts around it, every other attribute equal (KV heads, batch, cache dtype), linear in
    log(heads): within 10% of its own measured curve, where the median over every shape (which it
    took before) is several times off at one 1,024-token sequence (B200 / SGLang: 0.287 against the
    8-head curve's 0.046)."""
    from dataclasses import replace

    shipped = load_kernels(name)
    shape = shape | {"attention_dp": 1}
    curves = shipped.decode if decode else shipped.prefill
    held_curves = {**curves, kind: _without_heads(curves[kind], shape["heads"])}
    held = replace(shipped, **{"decode" if decode else "prefill": held_curves})
    own = shipped.attention_eff(decode, kind, key, shape)
    got = held.attention_eff(decode, kind, key, shape)
    lo, hi = (shipped.attention_eff(decode, kind, key, shape | {"heads": h}) for h in around)
    assert own is not None and got is not None and lo is not None and hi is not None
    t = math.log(shape["heads"] / around[0]) / math.log(around[1] / around[0])
    assert got == pytest.approx(lo + t * (hi - lo), rel=1e-9)
    assert got == pytest.approx(own, rel=0.1)
    # before: the shapes' first match (the decode curve of the cache dtype), else the median
    before = (measured_at(held_curves[kind].shapes, shape) or curves[kind])(key)
    assert abs(got / own - 1) < abs(before / own - 1)


@needs_aic
def test_qwen3_prefill_attention_held_out_by_layout_prices_near_its_own_rows(bench) -> None:
    """The benchmark's layout refit drops every attention row at 8 query heads per rank; Qwen3-235B
    TP8's GQA prefill at one 1,024-token sequence on B200 / SGLang then prices from 6 and 12 heads:
    within 10% of the shipped table (its own rows). From the median curve it was 0.23x (0.50 against
    2.14 ms per step)."""
    from kimi_adapter_core.backends.simulation.estimate.cost import price
    from kimi_adapter_core.backends.simulation.estimate.simulator import trace_kernels
    from kimi_adapter_core.backends.simulation.tables import calibrate

    qwen = _family(bench, "qwen3_moe")
    table = bench._table(calibrate.calibrate("b200_sxm", "sglang", bench.without_layout(qwen, 8, 8)), "TP8")
    loaded = load_spec(REPO / "specs" / "qwen3_moe.yaml")
    dep = Deployment(Parallel(8, 1, 8), 1, 1024, 0, False)
    device = get_device("b200")
    ops, _ = trace_kernels(loaded, model_inputs(loaded, None), dep)
    attention = [op for op in ops if op.kind == "attention"]
    assert attention
    held = sum(price(op, device, table).total for op in attention)
    own = sum(price(op, device, kernel_table(device, "sglang")).total for op in attention)
    assert held == pytest.approx(own, rel=0.1)


@needs_aic
def test_a_held_out_head_count_prices_vllm_mla_decode_from_the_floors_around_it(bench) -> None:
    """Held out (no row at 16 heads per rank), DeepSeek-V3 TP8 decode on vLLM still prices its MLA as
    the module: the attention from the median curve, the floor from 8 and 32 heads (it was priced as
    vLLM's standalone fp8-block GEMM rows, 85 us each on H200: decode 1.2-2.8x AIConfigurator)."""
    from kimi_adapter_core.backends.simulation.estimate.cost import fold_modules, price
    from kimi_adapter_core.backends.simulation.estimate.simulator import trace_kernels
    from kimi_adapter_core.backends.simulation.tables import calibrate

    deepseek = _family(bench, "deepseek_v3")
    fit = calibrate.calibrate("h200_sxm", "vllm", bench.without_layout(deepseek, 8, 8))
    table = bench._table(fit, "without TP8")
    loaded = load_spec(REPO / "specs" / "deepseek_v3.yaml")
    dep = Deployment(Parallel(8, 1, 8), 128, 1, 4096, True, kv_dtype="fp8")
    device = get_device("h200")
    ops, _ = trace_kernels(loaded, model_inputs(loaded, None), dep)
    kernels = fold_modules([price(op, device, table) for op in ops])
    core = next(k for k in kernels if k.op.kind == "attention" and "moe" in k.op.scope)
    inside = [k for k in kernels if k.op.scope == core.op.scope and ".self_attn" in k.op.module + "."]
    assert core.bound == "module" and {k.bound for k in inside if k is not core} == {"in_module"}
    row = _module_row("generation", 16, "fp8", "fp8_block", 128, 4096)
    assert sum(k.time for k in inside) * 1e3 == pytest.approx(row, rel=0.15)


@needs_aic
@pytest.mark.parametrize(
    ("system", "gpus"), [("b200_sxm", 2), ("b200_sxm", 4), ("gb200", 2), ("h200_sxm", 2)]
)
def test_an_all_reduce_prices_with_its_group_sizes_rows(system: str, gpus: int) -> None:
    """Each group size measured has its own all-reduce curve and latency: the 8-GPU ring efficiency
    did not carry to two GPUs (vLLM on B200, TP2: 17.7 us per 256 KiB all-reduce against its row's
    7.7, 25.6 us per 8 MiB against 50.6). Every measured size of a smaller group is reproduced within
    3%."""
    import pandas as pd

    from kimi_adapter_core.backends.simulation.estimate.cost import comm_time
    from kimi_adapter_core.backends.simulation.tables import calibrate, calibrate_rows

    device = get_device(calibrate.SYSTEMS[system])
    table = kernel_table(device, "vllm")
    rows = pd.read_parquet(calibrate_rows._tables(system) / "comm/vllm/0.24.0/custom_allreduce_perf.parquet")
    rows = rows[
        (rows.allreduce_dtype == "bfloat16")
        & (rows.num_gpus == gpus)
        & (rows.kernel_source == "vLLM_custom_graph")
    ]
    rows = rows[rows.message_size * 2 >= 2**16].groupby("message_size").latency.median()
    assert len(rows) > 10
    for size, latency in rows.items():
        comm = {"collective": "all_reduce", "bytes": size * 2.0, "group": gpus}
        seconds, _, measured = comm_time(device, comm, table)
        assert measured and seconds * 1e3 == pytest.approx(latency, rel=0.03), size
