"""``kadapt apply --verify`` checks the packed step graph it exports (issue 39: a step graph was exported
but never replayed by verify). The tiny model's requests are served through the saved step graph the way
an engine serves them - prompt chunks and decode tokens packed in one call, blocks out of order, unused
tokens on a scratch row, the ownership check on - and each request must equal ``generate()``. A step
graph that picks the wrong token's logits fails the check; one block-table row (no scratch row) is said,
not claimed."""

from __future__ import annotations

from pathlib import Path

import torch
from click.testing import CliRunner

from kimi_adapter_core.backends.extraction.equivalence.step_replay import NO_SCRATCH_ROW
from kimi_adapter_core.backends.extraction.runtime import step as runtime_step
from kimi_adapter_core.cli import cli

REPO = Path(__file__).resolve().parents[1]
STEP = ["--step-tokens", "12", "--step-logits", "6", "--no-cache"]


def _apply(tmp_path: Path, *args: str) -> tuple[int, str]:
    out = tmp_path / "out"
    result = CliRunner().invoke(
        cli, ["apply", str(REPO / "specs" / "llama.yaml"), "--verify", "--output-dir", str(out), *args]
    )
    return result.exit_code, result.output


def test_verify_serves_requests_through_the_step_graph(tmp_path: Path) -> None:
    code, output = _apply(tmp_path, *STEP, "--batch", "4")
    assert code == 0, output
    line, low = [line.strip() for line in output.splitlines() if "step graph" in line]  # fp32, bf16
    assert line.startswith("[ok] step graph: 3 requests of lengths [8, 6, 4]")
    assert "ownership checked" in line and "equal to model.generate row by row" in line
    assert low.startswith("[ok] step graph (bfloat16): ")


def test_a_step_graph_with_the_wrong_logits_rows_fails_verify(tmp_path: Path, monkeypatch) -> None:
    def off_by_one(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.index_select(0, (self._logit_indices + 1) % hidden_states.shape[0])

    monkeypatch.setattr(runtime_step.StepWrapper, "head_rows", off_by_one)
    code, output = _apply(tmp_path, *STEP, "--batch", "4")
    assert code != 0
    line = next(line for line in output.splitlines() if "step graph" in line)
    assert "[FAIL]" in line and "DIFFER from model.generate" in line
    assert "[ok] greedy generation" in output  # the prefill and decode graphs are unaffected


def test_one_block_table_row_is_said_not_claimed(tmp_path: Path) -> None:
    code, output = _apply(tmp_path, *STEP, "--batch", "1")
    assert code == 0, output
    assert "[ok] step graph" not in output and NO_SCRATCH_ROW[:60] in " ".join(output.split())


def test_verify_compares_the_aux_hidden_states_and_fails_the_wrong_layer(tmp_path: Path, monkeypatch) -> None:
    """``--step-aux-layers``: verify compares every asked row's aux hidden states with transformers'
    ``hidden_states[i + 1]``; a graph returning the layer before fails it while its logits still pass."""
    code, output = _apply(tmp_path, *STEP, "--batch", "4", "--step-aux-layers", "0,2")
    assert code == 0, output
    line = next(line.strip() for line in output.splitlines() if "step graph" in line)
    assert line.startswith("[ok] step graph") and "aux hidden states of layers [0, 2] max |diff|" in line
    keep = runtime_step.StepWrapper.layer_output

    def one_late(self, position: int, hidden_states: torch.Tensor) -> None:
        keep(self, position + 1, hidden_states)  # layer i - 1's output kept as layer i's

    monkeypatch.setattr(runtime_step.StepWrapper, "layer_output", one_late)
    code, output = _apply(tmp_path, *STEP, "--batch", "4", "--step-aux-layers", "1,2")
    assert code != 0
    line = next(line for line in output.splitlines() if "step graph" in line)
    assert "[FAIL]" in line and "equal to model.generate row by row" in line
