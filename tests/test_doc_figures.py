"""The benchmark figures docs/cost_model.md shows are the benchmark's current output (issue 38 item 4: "any
stale figure in docs/cost_model.md is regenerated from the bench, not typed"). Each ``<!-- bench:NAME -->``
block is rerun here; a pricing change that moves a figure fails this test until ``python
benchmarks/doc_figures.py --write`` regenerates the block (and the prose around it is reread)."""

from __future__ import annotations

import pytest
from fixtures.modules import REPO, import_path

from kimi_adapter_core.backends.simulation.estimate import aiconfigurator

doc_figures = import_path(REPO / "benchmarks" / "doc_figures.py", "doc_figures")
BLOCKS = doc_figures.blocks(doc_figures.DOC.read_text(encoding="utf-8"))
# computed through AIConfigurator's engine: their figures need the package
LIVE = ("aic", "expert-tp", "serving", "serving-gap")


def test_the_doc_holds_the_blocks_the_benchmark_can_write() -> None:
    assert {"a3", "aic", "published", "serving"} <= set(BLOCKS)
    assert set(BLOCKS) <= set(doc_figures.bench_simulation.SECTIONS)


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_each_generated_block_is_what_the_benchmark_prints_now(name: str) -> None:
    if name in LIVE and not aiconfigurator.available():
        pytest.skip("aiconfigurator-core not installed: its figures cannot be recomputed")
    assert BLOCKS[name] == doc_figures.render(name), (
        f"docs/cost_model.md's '{name}' block is stale: run python benchmarks/doc_figures.py --write {name} "
        "and reread the prose that cites it"
    )


def test_regenerating_replaces_only_the_named_blocks() -> None:
    text = "a\n<!-- bench:a3 -->\nold\n<!-- /bench:a3 -->\nb\n<!-- bench:aic -->\nkept\n<!-- /bench:aic -->\n"
    out = doc_figures.regenerate(text, {"a3": "```text\nnew\n```\n"})
    assert out == text.replace("old\n", "```text\nnew\n```\n")
    assert doc_figures.blocks(out) == {"a3": "```text\nnew\n```\n", "aic": "kept\n"}
