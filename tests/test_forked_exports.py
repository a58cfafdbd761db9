"""Exports in two processes (``backends/extraction/forked.py``): the same bytes and the same report as
one process, the child's errors raised here, a child that dies named, never a hang."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kimi_adapter_core.backends.extraction import pipeline
from kimi_adapter_core.backends.extraction.summary import SECOND_PROCESS
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import Refusal

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="no os.fork on this platform")


def apply(spec: str, out: Path, processes: int, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("KADAPT_EXPORT_PROCESSES", str(processes))
    args = ["apply", str(REPO / "specs" / f"{spec}.yaml"), "--no-cache", "--output-dir", str(out)]
    return CliRunner().invoke(cli, [*args, "--format", "json"], catch_exceptions=False)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


@pytest.mark.parametrize("spec", ["kimi_k25"])  # 4 graphs, 2 per process; K1 reached in both
def test_two_processes_write_the_same_bytes_and_report(spec, tmp_path, monkeypatch):
    one = apply(spec, tmp_path / "one", 1, monkeypatch)
    two = apply(spec, tmp_path / "two", 2, monkeypatch)
    assert one.exit_code == two.exit_code == 0, two.output
    assert files(tmp_path / "one") == files(tmp_path / "two")
    first, second = json.loads(one.stdout), json.loads(two.stdout)
    assert first["ledger"] == second["ledger"]  # each patch's reach: the child's calls counted too
    assert any(e.get("reached") for e in second["ledger"]["entries"])
    steps = [s["step"] for s in second["extraction"]["steps"]]
    assert not any(SECOND_PROCESS in s for s in (s["step"] for s in first["extraction"]["steps"]))
    assert f"export prefill_mm{SECOND_PROCESS}" in steps and f"export vision{SECOND_PROCESS}" in steps
    own = sum(s["seconds"] for s in second["extraction"]["steps"] if SECOND_PROCESS not in s["step"])
    assert second["extraction"]["seconds"] == pytest.approx(own, abs=0.01)  # the child ran beside it
    for kind, graph in first["extraction"]["graphs"].items():
        assert {**graph, "path": None} == {**second["extraction"]["graphs"][kind], "path": None}


def failing_decode(how: str):
    build = pipeline.build_graph

    def build_graph(kind, *args, **kwargs):
        if kind == "decode":  # the second of two graphs: the child builds it
            if how == "die":
                os._exit(3)
            raise Refusal("stack-differs", "the decode graph cannot be built (test)")
        return build(kind, *args, **kwargs)

    return build_graph


def test_an_error_in_the_second_process_is_reported_here(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "build_graph", failing_decode("refuse"))
    result = apply("llama", tmp_path / "out", 2, monkeypatch)
    assert result.exit_code == 1
    assert "the decode graph cannot be built (test)" in result.output
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_a_second_process_that_dies_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(pipeline, "build_graph", failing_decode("die"))
    result = apply("llama", tmp_path / "out", 2, monkeypatch)
    assert result.exit_code == 1
    assert "the export process building decode ended without a result (exit status 3)" in result.output
