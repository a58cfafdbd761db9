"""``kadapt apply --without ID``: what each extraction entry of a shipped spec is for, shown by removing it.

Each test names the entry's ``why`` and proves it: the export refuses, ``--verify`` fails, or the graph
grows. An entry whose removal changes nothing would fail its test here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.shared_apply import SharedApplies

from kimi_adapter_core.cli import cli

SPEC = str(Path(__file__).resolve().parents[1] / "specs" / "deepseek_v3.yaml")


def apply(tmp_path: Path, *args: str):
    return CliRunner().invoke(cli, ["apply", SPEC, "--output-dir", str(tmp_path), *args])


def test_without_unknown_id_is_a_usage_error(tmp_path: Path) -> None:
    result = apply(tmp_path, "--without", "K9")
    assert result.exit_code == 2 and "no entry K9 in spec deepseek_v3; ids: X1, X2, K1" in result.output


@pytest.mark.slow
def test_x1_eager_attention_is_what_makes_the_ir_right(tmp_path: Path) -> None:
    """Without X1 transformers picks SDPA; the exported graph then disagrees with generate()."""
    result = apply(tmp_path, "--without", "X1", "--verify")
    assert result.exit_code == 1 and "[FAIL] prefill logits" in result.output


@pytest.mark.slow
def test_x2_batched_mm_experts_keep_custom_ops_out(tmp_path: Path) -> None:
    """Without X2 the experts run transformers' grouped_mm: the full-size bf16 graph holds _grouped_mm
    (aligned strides CPU executors lack), and the fp32 verify model's layers do not even run on the meta
    device, where grouped_mm takes bf16 alone: the layer probe refuses the export, located, before it."""
    result = apply(tmp_path, "--without", "X2", "--verify")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "refused (not-exportable): DeepseekV3DecoderLayer does not fit" in result.output
    assert "Expected inputs of BF16 type" in result.output


@pytest.mark.slow
def test_k1_functional_expand_kv_keeps_the_graph_small(tmp_path: Path, shipped_apply: SharedApplies) -> None:
    """K1 is not needed for correctness (export functionalizes upstream's copy_), only for size."""
    nodes = {}
    # with every entry: the spec's own run, which every test reading it shares
    for label, result in (
        ("with", shipped_apply(Path(SPEC).stem)),
        ("without", apply(tmp_path / "without", "--format", "json", "--without", "K1")),
    ):
        assert result.exit_code == 0, result.output
        nodes[label] = json.loads(result.stdout)["extraction"]["graphs"]["prefill"]["nodes"]
    assert nodes["without"] - nodes["with"] == 6 * 61  # empty + slice_scatter instead of one cat, per layer
