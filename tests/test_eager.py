"""Steps an engine runs without CUDA graphs (``estimate/eager.py``, ``kadapt simulate --eager``).

What must hold: an eager step takes at least its launched kernels x the host time per launch, every
kernel at least that and none less than the same kernel graphed (a kernel longer than the host time
keeps its price and bound); a step with no host time (every point that ran CUDA graphs) is exactly the
step as priced before; ``--eager`` says so, with the host time, in text and JSON, for a step and for
``--concurrency`` (whose decode step it lengthens), and is refused where it would go unreported; a
graphed step's output does not mention it.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner
from fixtures.spec_files import REPO

from kimi_adapter_core.backends.simulation.estimate import eager
from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import UsageError
from kimi_adapter_core.spec import load_spec

HOST = eager.HOST_US * 1e-6
STEP = ["simulate", "llama", "--device", "h100", "--decode", "--batch", "8", "--context-len", "544"]
CONCURRENCY = ["simulate", "llama", "--device", "h100", "--isl", "512", "--osl", "64", "--concurrency", "8"]


def _decode(host: float):  # noqa: ANN202 - a Simulation (the simulator imports torch)
    spec = load_spec(REPO / "specs" / "llama.yaml")
    dep = Deployment(Parallel(), 8, 1, 544, True, eager_host=host)
    return simulate(model_inputs(spec, None), spec, dep, get_device("h100"))


def test_an_eager_step_takes_at_least_its_launches_times_the_host_time() -> None:
    graphed, eager_step = _decode(0.0), _decode(HOST)
    launches = eager.launches(eager_step.kernels)
    assert launches == eager.launches(graphed.kernels) > 100  # the same kernels, launched once each
    assert eager_step.step_time >= launches * HOST
    assert eager_step.step_time > graphed.step_time
    floored = 0
    for g, e in zip(graphed.kernels, eager_step.kernels, strict=True):
        assert (e.op.scope, e.op.module, e.op.name) == (g.op.scope, g.op.module, g.op.name)
        assert e.time == pytest.approx(max(g.time, HOST), rel=1e-12)
        if g.time < HOST:
            assert e.bound == "host"
            floored += 1
        else:
            assert (e.time, e.bound) == (g.time, g.bound)  # a kernel longer than a launch keeps its price
    assert 0 < floored < len(graphed.kernels)  # the llama decode step has kernels on both sides of 41.5 us
    # the cost model's source summary names the host for the kernels it bounds, not the tables
    hosted = eager.launches(k for k in eager_step.kernels if k.bound == "host")  # each once per layer
    assert eager_step.sources()[eager.HOST_SOURCE] == (floored, pytest.approx(hosted * HOST))
    assert eager.HOST_SOURCE not in graphed.sources()


def test_a_graphed_step_is_the_step_as_priced() -> None:
    """No host time: every kernel keeps its time and bound (what every CUDA-graph point is priced with)."""
    graphed = _decode(0.0)
    assert eager.eager_step(graphed.kernels, 0.0) == list(graphed.kernels)
    assert "host" not in {k.bound for k in graphed.kernels}


def test_a_negative_host_time_is_refused() -> None:
    dep = Deployment(Parallel(), 1, 1, 0, True, eager_host=-1e-6)
    spec = load_spec(REPO / "specs" / "llama.yaml")
    with pytest.raises(UsageError, match="host time per eager launch must be >= 0"):
        dep.check(model_inputs(spec, None).arch.structure)


def test_eager_step_text_and_json() -> None:
    text = CliRunner().invoke(cli, [*STEP, "--eager"])
    assert text.exit_code == 0, text.output
    said = f"priced eager (no CUDA graphs): every launched kernel takes at least {eager.HOST_US:g} us"
    assert said in text.output
    doc = json.loads(CliRunner().invoke(cli, [*STEP, "--eager", "--format", "json"]).output)
    assert doc["eager"] == {"cuda_graphs": False, "host_us_per_kernel": pytest.approx(eager.HOST_US)}
    assert "host" in {op["bound"] for op in doc["ops"]}
    assert "eager" not in CliRunner().invoke(cli, STEP).output
    graphed = json.loads(CliRunner().invoke(cli, [*STEP, "--format", "json"]).output)
    assert "eager" not in graphed and "host" not in {op["bound"] for op in graphed["ops"]}
    assert doc["step_time_s"] > graphed["step_time_s"]


def test_eager_concurrency_text_and_json() -> None:
    text = CliRunner().invoke(cli, [*CONCURRENCY, "--eager"])
    assert text.exit_code == 0, text.output
    assert f"at least {eager.HOST_US:g} us of host time" in text.output
    eager_doc = json.loads(CliRunner().invoke(cli, [*CONCURRENCY, "--eager", "--format", "json"]).output)
    graphed_doc = json.loads(CliRunner().invoke(cli, [*CONCURRENCY, "--format", "json"]).output)
    assert eager_doc["eager"]["host_us_per_kernel"] == pytest.approx(eager.HOST_US)
    assert "eager" not in graphed_doc
    # the decode step it prices is ``simulate --decode --eager``'s at the mean context
    step = _decode(HOST)
    assert eager_doc["decode"]["step_time_s"] == pytest.approx(step.step_time, rel=1e-9)
    assert eager_doc["decode"]["step_time_s"] >= eager.launches(step.kernels) * HOST
    assert eager_doc["tpot_s"] > graphed_doc["tpot_s"]
    assert eager_doc["mixed_step_time_s"] >= graphed_doc["mixed_step_time_s"]


@pytest.mark.parametrize(
    ("extra", "flag"),
    [(["--sweep", "--decode"], "--sweep"), (["--steps", "trace.json"], "--steps")],
)
def test_eager_is_refused_where_it_would_go_unreported(extra: list[str], flag: str) -> None:
    result = CliRunner().invoke(cli, ["simulate", "llama", "--device", "h100", "--eager", *extra])
    assert result.exit_code == 2 and f"--eager prices one step or --concurrency; drop {flag}" in result.output
