"""``plan`` and ``simulate`` on a stack whose attention layers cache different KV shapes (MiMo-V2-Flash:
the sliding layers have twice the config's KV heads, by its modelling code; Gemma-4's full layers are
wider with fewer KV heads, by its config).

``plan`` splits each shape's k/v projections by that shape's own KV heads (TP replicates a shape's heads
past their own count, not the stack's). ``simulate`` traces each shape as a layer kind of its own
(``rank_config.layer_kinds``), writes every shape's per-rank KV heads where the config states them
(``per_layer_rank_sizes``) and holds each traced attention to its own shape; a TP degree at which the
family's code would build other heads than TP shards (MiMo past TP = its 2 KV heads) is refused by
``Parallel.check``, naming the layer and the highest TP that holds, before any work.
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
from kimi_adapter_core.backends.simulation.search.grid import layouts
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import UsageError


def _ops(result_output: str) -> dict[str, dict]:
    return {f"{op['scope']}/{op['op']}": op for op in json.loads(result_output)["ops"]}


@pytest.mark.parametrize(
    "phase",
    [["--query-len", "8"], ["--decode", "--context-len", "4"]],  # within the sliding window of 8
    ids=["prefill", "decode"],
)
def test_simulate_prices_each_kv_shape_as_a_kind_of_its_own(tmp_path: Path, phase: list[str]) -> None:
    """Was: refused at the gate ("simulate prices one KV shape for every attention layer")."""
    spec = mimo_spec(tmp_path)
    command = ["simulate", str(spec.path), "--device", "h200", "--tp", "2", "--format", "json", *phase]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 0, result.output
    ops = _ops(result.stdout)
    name = "attention_decode" if "--decode" in phase else "flash_attention_prefill"
    full, sliding = ops[f"dense/{name}"], ops[f"moe.4x16/{name}"]  # the sliding layer's own kind
    # one token of a rank's cache: the sliding layer's 4 KV heads split to 2, the full layer's 2 to 1
    assert sliding["bytes"] > full["bytes"]


def test_a_tp_degree_the_familys_code_cannot_shard_is_refused_before_any_work(tmp_path: Path) -> None:
    """MiMo's sliding layers build twice the stack's per-rank KV heads: at TP 4 the stack's 2 are
    replicated (1 a rank), so a rank would build 2 sliding heads where TP shards 4 into 1 each."""
    spec = mimo_spec(tmp_path)
    command = ["simulate", str(spec.path), "--device", "h200", "--tp", "4", "--query-len", "8"]
    result = CliRunner().invoke(cli, command)
    assert result.exit_code == 2, result.output
    assert "--tp 4: layer 1 caches 4 KV heads, 2x the stack's 2" in result.output
    assert "use --tp 2 or less" in result.output and "Traceback" not in result.output
    dep = Deployment(Parallel(tp=4), batch=1, query_len=8, context_len=0, decode=False)
    with pytest.raises(UsageError, match="use --tp 2 or less"):
        simulate(model_inputs(spec, None), spec, dep, get_device("h200", None))


def test_the_sweep_searches_only_the_layouts_it_can_shard(tmp_path: Path) -> None:
    structure = model_inputs(mimo_spec(tmp_path), None).arch.structure
    assert {par.tp for par in layouts(structure, 8)} == {1, 2}  # TP 4 and 8 would build wrong heads


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
