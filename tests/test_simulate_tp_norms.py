"""Issue 38: a norm spanning a whole tensor-parallel projection, and ``--device``'s help.

OLMoE's ``q_norm`` / ``k_norm`` normalise all heads of q / k at once (a weight ``hidden_size`` wide)
while each TP rank holds 1/TP of the projection's columns: ``kadapt simulate --tp 8`` ended in a
broadcast traceback. The rank now holds its slice of the norm weight and the norm's statistics are
all-reduced across the TP group (one fp32 per row). The spec is the family matrix's for ``olmoe``
(``families.trial.write_spec``) on a small OLMoE config built here, so the test needs no hub.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from transformers import OlmoeConfig

from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.rank_model import RankModel
from kimi_adapter_core.backends.simulation.model.tracer import Op
from kimi_adapter_core.backends.simulation.tables.device import SHIPPED_DIR
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.families.trial import write_spec
from kimi_adapter_core.spec import Spec, load_spec

HIDDEN, HEADS = 512, 16  # q_norm is HIDDEN wide; at TP 8 a rank holds 2 heads x 32 = 64 columns
PATHS = {"language_model": "model", "language_layers": "model.layers", "lm_head": "lm_head"}
NORM_AR = "tp_all_reduce(norm_statistics)"


def olmoe_spec(folder: Path, **config: object) -> Spec:
    """The family matrix's OLMoE spec on a small OLMoE config (``config`` overrides its values)."""
    small = dict(
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        intermediate_size=256,
        num_experts=8,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        vocab_size=1024,
    )
    raw = OlmoeConfig(**{**small, **config}).to_dict()
    return load_spec(write_spec(folder, "olmoe", raw, PATHS))


@pytest.fixture(scope="module")
def spec(tmp_path_factory: pytest.TempPathFactory) -> Spec:
    return olmoe_spec(tmp_path_factory.mktemp("olmoe"))


def traced(spec: Spec, tp: int, batch: int = 4) -> tuple[RankModel, list[Op]]:
    """One decode step of the per-rank model at ``tp`` (EP = TP); the model and its recorded ops."""
    dep = Deployment(Parallel(tp, 1, tp), batch, 1, 128, True)
    inputs = model_inputs(spec, None)
    model = RankModel(spec, inputs, dep)
    return model, model.trace(inputs, dep).ops


def facts(op: Op) -> tuple[object, ...]:
    """What a pricer reads of ``op``, without the tensor ids a trace numbers afresh."""
    attrs = {k: v for k, v in op.attrs.items() if k != "activation"}
    return (op.name, op.module, op.kind, op.flops, op.bytes, op.comm, attrs, [n for _, _, n in op.weights])


def test_olmoe_at_tp8_ep8_simulates(spec: Spec) -> None:
    result = CliRunner().invoke(
        cli, ["simulate", str(spec.path), "--tp", "8", "--ep", "8", "--device", "h200"]
    )
    assert result.exit_code == 0, result.output
    assert "tp=8 dp=1 ep=8" in result.output
    assert "moe_layer.self_attn.q_norm" in result.output and NORM_AR in result.output


def test_each_rank_holds_its_slice_of_the_norm_and_all_reduces_the_statistics(spec: Spec) -> None:
    batch, tp = 4, 8
    model, ops = traced(spec, tp, batch)
    attention = model.parts.layer("moe").self_attn
    assert tuple(attention.q_norm.weight.shape) == (HIDDEN // tp,)
    assert tuple(attention.k_norm.weight.shape) == (HIDDEN // tp,)
    for norm in ("q_norm", "k_norm"):
        module = f"moe_layer.self_attn.{norm}"
        at = [i for i, op in enumerate(ops) if op.module == module and op.name == NORM_AR]
        assert len(at) == 1, [op.name for op in ops if op.module == module]
        reduce = ops[at[0]]
        # right after the local sum of squares, one fp32 per token row, across the TP group
        assert ops[at[0] - 1].name == "mean" and ops[at[0] - 1].module == module
        assert reduce.kind == "comm" and reduce.comm == {
            "collective": "all_reduce",
            "bytes": batch * 4,
            "group": tp,
        }
        read = [n for op in ops if op.module == module for _, _, n in op.weights]
        assert read == [HIDDEN // tp]  # the weight multiply reads the rank's slice


def test_a_reused_rank_model_traces_the_split_norm_as_a_fresh_one_does(spec: Spec) -> None:
    model, first = traced(spec, 8)
    dep = Deployment(Parallel(8, 1, 8), 4, 1, 128, True)
    again = model.trace(model_inputs(spec, None), dep).ops
    assert [facts(op) for op in again] == [facts(op) for op in first]
    assert sum(op.name == NORM_AR for op in again) == 2


def test_without_tensor_parallelism_the_norm_is_whole_and_nothing_is_reduced(spec: Spec) -> None:
    model, ops = traced(spec, 1)
    assert tuple(model.parts.layer("moe").self_attn.q_norm.weight.shape) == (HIDDEN,)
    assert not [op for op in ops if op.kind == "comm"]


def test_a_norm_mismatch_that_is_not_a_tp_split_is_a_located_error(tmp_path: Path) -> None:
    # head_dim 16 != hidden / heads: q is 16 x 16 = 256 wide, q_norm 512 (HF's own model fails too)
    spec = olmoe_spec(tmp_path, head_dim=16)
    with pytest.raises(KadaptError) as caught:
        traced(spec, 2)
    message = str(caught.value)
    assert "spec olmoe at TP 2" in message and "moe_layer.self_attn.q_norm" in message
    assert "aten.mul" in message and "on 512 4x1x128" in message
    result = CliRunner().invoke(cli, ["simulate", str(spec.path), "--tp", "2", "--device", "h200"])
    assert result.exit_code == 1 and "error: simulate cannot run" in result.output, result.output
    assert "Traceback" not in result.output


def test_device_help_lists_every_shipped_profile_without_torch() -> None:
    shipped = sorted(
        yaml.safe_load(f.read_text(encoding="utf-8"))["name"] for f in SHIPPED_DIR.glob("*.yaml")
    )
    assert {"b200", "gb200"} <= set(shipped)
    code = (
        "import sys\nsys.modules['torch'] = None\n"
        "from click.testing import CliRunner\nfrom kimi_adapter_core.cli import cli\n"
        "for command in ('plan', 'simulate'):\n"
        "    r = CliRunner().invoke(cli, [command, '--help'], terminal_width=400)\n"
        "    assert r.exit_code == 0, r.output\n"
        "    print(next(line for line in r.output.splitlines() if line.startswith('  --device ')))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert len(lines) == 2
    for line in lines:
        assert f"Device profile name: {', '.join(shipped)} (see docs/cost_model.md; profiles of your" in line
