"""``plan`` and ``simulate`` on a stack whose attention layers cache different KV shapes (MiMo-V2-Flash:
the sliding layers have twice the config's KV heads, by its modelling code).

``plan`` splits each shape's k/v projections by that shape's own KV heads (TP replicates a shape's heads
past their own count, not the stack's). ``simulate`` traces each attention kind from one layer with the
stack's per-rank KV heads, which the family's code turns into a wrong count for the other shape wherever
TP replicates one shape's heads and splits the other's: it refuses such a stack at the gate, naming the
shapes, before any work, rather than price it wrong or stop on a misleading mismatch.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_per_layer_kv import SPEC, mimo_spec
from transformers import MiMoV2FlashConfig

from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError

# the tiny MiMo's (families.tiny) per-token (heads, dim) of key and value: full layer, sliding layer
SHAPES = "(((2, 16), (2, 16)), ((4, 16), (4, 16))"


@pytest.mark.parametrize(
    "phase",
    [["--query-len", "8"], ["--decode", "--context-len", "32"], ["--sweep"]],
    ids=["prefill", "decode", "sweep"],
)
def test_simulate_refuses_per_layer_kv_shapes_at_the_gate(tmp_path: Path, phase: list[str]) -> None:
    """Was: the trace stopped on "the per-rank attention of layer 1 runs 2 query / 2 KV heads ...", a
    config-bridge diagnosis of a stack kadapt does not price."""
    spec = mimo_spec(tmp_path)
    command = ["simulate", str(spec.path), "--device", "h200", "--tp", "2", *phase]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 1, result.output
    assert "mimo_v2_flash.yaml:4:1: simulate prices one KV shape for every attention layer" in result.output
    assert f"attention layers cache 2 {SHAPES}; (heads, dim)" in result.output
    assert "per-rank attention" not in result.output


def test_the_simulate_library_call_refuses_them_too(tmp_path: Path) -> None:
    spec = mimo_spec(tmp_path)
    dep = Deployment(Parallel(tp=2), batch=1, query_len=8, context_len=0, decode=False)
    with pytest.raises(KadaptError) as refused:
        simulate(model_inputs(spec, None), spec, dep, get_device("h200", None))
    assert refused.value.location == spec.locate("gate")
    assert SHAPES in refused.value.message


def test_plan_splits_each_shapes_kv_projections_by_its_own_kv_heads(tmp_path: Path) -> None:
    """Published MiMo-V2-Flash defaults at TP 8: hidden 4096, 192-wide keys and 128-wide values; the 9
    full layers have 4 KV heads (fewer than TP: replicated, one a rank, a quarter of the tensor), the 39
    sliding layers 8 (split, an eighth). Was: the sliding layers' split by the stack's 4 too (a quarter)."""
    (tmp_path / "mimo_v2_flash").mkdir()
    (tmp_path / "mimo_v2_flash" / "config.json").write_text(MiMoV2FlashConfig().to_json_string())
    (tmp_path / "mimo_v2_flash.yaml").write_text(SPEC)
    command = ["plan", str(tmp_path / "mimo_v2_flash.yaml"), "--tp", "8", "--format", "json"]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 0, result.output
    groups = {g["name"]: g for g in json.loads(result.output)["weights"]["groups"]}
    for proj, width in (("k_proj", 192), ("v_proj", 128)):
        full, sliding = groups[f"attn.{proj}"], groups[f"attn.{proj}.8x192"]
        assert full["params"] == 9 * 4 * width * 4096
        assert full["params_per_device"] == 9 * 1 * width * 4096
        assert sliding["params"] == 39 * 8 * width * 4096
        assert sliding["params_per_device"] == 39 * 1 * width * 4096
