"""``kadapt simulate``: one traced step is positive, internally consistent and moves the right way."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_plan import sizing_spec  # tests/ is on sys.path (no package, rootdir import mode)

from kimi_adapter_core.backends.simulation.deployment import Deployment
from kimi_adapter_core.backends.simulation.device import get_device
from kimi_adapter_core.backends.simulation.inputs import model_inputs
from kimi_adapter_core.backends.simulation.parallel import Parallel
from kimi_adapter_core.backends.simulation.simulator import Simulation, simulate
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import Spec, load_spec


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return sizing_spec(tmp_path_factory.mktemp("spec"))


@pytest.fixture(scope="module")
def spec(spec_path: Path) -> Spec:
    return load_spec(spec_path)


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
    return simulate(
        inputs.arch, inputs.text_config, dep, inputs.policy, inputs.quant_label, get_device(device)
    )


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
    assert sim.step_time > 0 and all(r.time > 0 for r in rows)
    assert sum(r.time for r in rows) == pytest.approx(sim.step_time)  # the table accounts for the whole step
    names = {r.name for r in rows}
    assert "grouped_gemm(routed_experts)" in names and "tp_all_reduce" in names
    assert "ep_dispatch(all_to_all)" in names and "ep_combine(all_to_all)" in names
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
    assert decode.memory.kv_cache == pytest.approx(
        32 * (4096 + 1) * 1152 * 61
    )  # latent KV, replicated over TP


def test_quant_modes_change_prices(spec: Spec) -> None:
    w4a8, bf16 = run(spec, quant="W4A8", dp=2, ep=16, tp=8), run(spec, quant="BF16", dp=2, ep=16, tp=8)
    assert w4a8.memory.weights < bf16.memory.weights
    assert w4a8.step_time < bf16.step_time  # decode reads weights: 4-bit is faster


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
        (["--device", "tpu9"], 1, "known devices: a100, atlas_800_a3, h100, h200, h800"),
        (["--device", "h200", "--quant", "NF4"], 1, "BF16, W8A8, W4A8, W4A16"),
        (["--device", "h200", "--tp", "8", "--ep", "7"], 2, "does not divide"),
        (["--device", "h200", "--decode", "--query-len", "4"], 2, "--query-len"),
    ],
)
def test_cli_errors(spec_path: Path, args: list[str], code: int, message: str) -> None:
    result = CliRunner().invoke(cli, ["simulate", str(spec_path), *args])
    assert result.exit_code == code, result.output
    assert message in result.output
