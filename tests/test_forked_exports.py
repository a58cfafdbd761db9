"""Exports in forked processes (``backends/extraction/job/forked.py``): the same bytes and the same report
as one process, this process tracing nothing, a child's errors raised here, a child that dies named
and its half-written files removed, never a hang."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kimi_adapter_core.backends.extraction.job import forked, pipeline, write
from kimi_adapter_core.backends.extraction.job.summary import process_mark
from kimi_adapter_core.checkpoint.tensors import TensorType
from kimi_adapter_core.checkpoint.weight_map import same_document
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
def test_two_processes_write_the_same_bytes_and_report(spec, tmp_path, monkeypatch, shipped_apply):
    """The two-process side is the session's shared run of the README's command (``shipped_apply``:
    a user's first run, cache miss, the export processes kadapt picks: two here, as the process marks
    below confirm); the one-process side is run here with ``--no-cache``. ``--verify`` (the shared
    run's) only adds its ``verify`` report after the extraction, so that key alone is left out."""
    monkeypatch.delenv("KADAPT_EXPORT_PROCESSES", raising=False)  # what the shared run saw
    if forked.export_processes() == 2:
        two = shipped_apply(spec)  # asked for before anything is patched (fixtures/shared_apply.py)
        assert two.exit_code == 0, two.output
        two_out, second = two.out, two.data()
        assert second["extraction"]["cache"]["hit"] is False  # traced, not restored
        second.pop("verify")
    else:  # one CPU: kadapt would pick one process, so the two-process run is this test's own
        two = apply(spec, tmp_path / "two", 2, monkeypatch)
        two_out, second = tmp_path / "two", json.loads(two.stdout)
    one = apply(spec, tmp_path / "one", 1, monkeypatch)
    assert one.exit_code == two.exit_code == 0, two.output
    assert files(tmp_path / "one") == files(two_out)
    first = json.loads(one.stdout)
    assert "verify" not in first
    assert first["ledger"] == second["ledger"]  # each patch's reach: the child's calls counted too
    assert any(e.get("reached") for e in second["ledger"]["entries"])
    steps = [s["step"] for s in second["extraction"]["steps"]]
    assert not any("(process" in s for s in (s["step"] for s in first["extraction"]["steps"]))
    assert f"export prefill{process_mark(1)}" in steps and f"export decode{process_mark(1)}" in steps
    assert f"export prefill_mm{process_mark(2)}" in steps and f"export vision{process_mark(2)}" in steps
    own = sum(s["seconds"] for s in second["extraction"]["steps"] if "(process" not in s["step"])
    assert second["extraction"]["seconds"] == pytest.approx(own, abs=0.01)  # the children ran beside it
    assert "wait for exports" in steps and "wait for writes" in steps
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


def test_this_process_traces_nothing_when_two_children_do(tmp_path, monkeypatch):
    """The point of two children: torch's export machinery and the graphs never load here, so the
    run's peak memory is one child's, not this process's plus a child's."""
    built = tmp_path / "built"
    build = pipeline.build_graph

    def build_graph(kind, *args, **kwargs):
        with built.open("a") as record:  # a child's memory is its own: the file is shared
            record.write(f"{os.getpid()} {kind}\n")
        return build(kind, *args, **kwargs)

    monkeypatch.setattr(pipeline, "build_graph", build_graph)
    assert apply("llama", tmp_path / "out", 2, monkeypatch).exit_code == 0
    pids = dict(reversed(line.split()) for line in built.read_text().splitlines())
    assert sorted(pids) == ["decode", "prefill"]
    assert os.getpid() not in {int(pid) for pid in pids.values()}
    assert len(set(pids.values())) == 2  # one child each


@pytest.mark.parametrize(
    ("tasks", "processes", "sizes"),
    [(4, 2, [2, 2]), (3, 2, [2, 1]), (2, 2, [1, 1]), (2, 4, [1, 1]), (5, 3, [2, 2, 1]), (3, 1, [3])],
)
def test_tasks_are_split_into_contiguous_groups(tasks, processes, sizes):
    names = [(str(i), lambda: None) for i in range(tasks)]
    groups = forked.groups_of(names, processes)
    assert [len(g) for g in groups] == sizes
    assert [name for group in groups for name, _ in group] == [name for name, _ in names]


def test_a_child_that_dies_while_writing_leaves_no_temp_file(tmp_path, monkeypatch):
    """The parent named every temp file before forking, so it removes what a dead child left."""
    real = write.write_new

    def write_new(path, chunks, *, target):
        if target.name.endswith("decode_ir.json"):
            path.write_text('{"half": ')  # a partial file under the name the parent chose
            os._exit(5)
        return real(path, chunks, target=target)

    monkeypatch.setattr(write, "write_new", write_new)
    out = tmp_path / "out"
    out.mkdir()
    (out / "llama_decode_ir.json").write_text('{"previous": true}')
    result = apply("llama", out, 2, monkeypatch)
    assert result.exit_code == 1
    assert "the export process building decode ended without a result (exit status 5)" in result.output
    assert sorted(p.name for p in out.iterdir()) == ["llama_decode_ir.json"]  # no temp file, no new file
    assert (out / "llama_decode_ir.json").read_text() == '{"previous": true}'


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


def test_the_childs_weight_map_is_used_only_when_it_is_the_runs(tmp_path, monkeypatch):
    """The child maps its own graphs' weights while this process traces; the run uses that map only
    when it describes every graph's weights, else maps them itself: the same bytes either way."""
    calls: list[int] = []  # this process's maps (a child's calls land in its own copy of the list)
    real = pipeline.weight_map_document
    monkeypatch.setattr(pipeline, "weight_map_document", lambda *a, **k: calls.append(1) or real(*a, **k))
    used = apply("llama", tmp_path / "used", 2, monkeypatch)
    mapped_here = len(calls)
    monkeypatch.setattr(pipeline, "same_document", lambda mine, theirs: False)
    calls.clear()
    recomputed = apply("llama", tmp_path / "recomputed", 2, monkeypatch)
    assert used.exit_code == recomputed.exit_code == 0, recomputed.output
    assert (mapped_here, len(calls)) == (1, 2)  # the layout check maps the templates in both runs
    assert files(tmp_path / "used") == files(tmp_path / "recomputed")
    steps = [s["step"] for s in json.loads(used.stdout)["extraction"]["steps"]]
    assert f"weight map{process_mark(2)}" in steps


def test_a_weight_map_is_the_same_document_only_for_the_same_weights_and_head():
    fp32, bf16 = TensorType((4, 4), "float32"), TensorType((4, 4), "bfloat16")
    run = {"model.embed.weight": bf16, "lm_head.weight": bf16}
    assert same_document(run, dict(reversed(run.items())))  # order aside, the same map
    assert not same_document(run, {**run, "model.norm.weight": fp32})  # a weight only one reads
    assert not same_document(run, {**run, "lm_head.weight": fp32})  # another type
    heads = {"a.lm_head.weight": bf16, "b.lm_head.weight": bf16}
    assert not same_document(heads, dict(reversed(heads.items())))  # another head: another storage
