"""What the README and docs/cli.md show that another file decides, checked without running a model.

The README's shipped-spec table (every spec in ``specs/``, each with its file's line count) and the family
matrix's counts (``docs/families.md``'s summary line) were typed by hand and had drifted (four line counts,
a spec missing, the matrix at 128 adapted where the page said 133). Two ``kadapt apply`` examples, in
``apply --help`` and docs/cli.md, sized a paged pool (``--num-blocks 64``) below one row at the spec's
``max_cache_len``, so a newcomer's first paste was an error; the paged-size rule is torch-free, so every
example that sizes a pool is held to it here."""

from __future__ import annotations

import json
import re
import shlex

import pytest
from click.testing import CliRunner
from fixtures.modules import REPO

from kimi_adapter_core.cli import cli
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.loader import resolve_spec_path
from kimi_adapter_core.spec.model import paged_size_problems

README = (REPO / "README.md").read_text(encoding="utf-8")
ROW = re.compile(r"^\| `specs/(?P<name>\w+)\.yaml` \|.*\| (?P<lines>\d+) \|$", re.MULTILINE)
# the spec the README names in its own paragraph (the same model on its hub remote code), not in the table
BESIDE_THE_TABLE = {"kimi_k25_remote"}


def test_the_spec_table_lists_every_shipped_spec_with_its_line_count() -> None:
    table = {m["name"]: int(m["lines"]) for m in ROW.finditer(README)}
    shipped = {path.stem: path for path in (REPO / "specs").glob("*.yaml")}
    assert set(table) == set(shipped) - BESIDE_THE_TABLE
    counts = {name: len(shipped[name].read_text(encoding="utf-8").splitlines()) for name in table}
    assert table == counts


def test_the_family_counts_are_the_pages() -> None:
    page = (REPO / "docs" / "families.md").read_text(encoding="utf-8")
    written = re.search(r"against transformers (?P<release>[\d.]+)", page)
    summary = re.search(
        r"\*\*(?P<types>\d+) model types: (?P<adapted>\d+) adapted, (?P<refused>\d+) refused, "
        r"(?P<failed>\d+) failed, (?P<untested>\d+) untested\.\*\*",
        page,
    )
    assert written and summary and summary["failed"] == "0"
    said = (
        f"on transformers {written['release']}, {summary['types']} types, {summary['adapted']} adapted, "
        f"{summary['refused']} refused, {summary['untested']} untested"
    )
    assert said in " ".join(README.split()), said


def _apply_examples() -> list[str]:
    """Every ``kadapt apply`` example line of ``apply --help`` and of docs/cli.md's code blocks."""
    help_text = CliRunner().invoke(cli, ["apply", "--help"]).output
    shown = help_text.split("Examples:\n")[1].split("\n\n")[0].splitlines()
    doc = (REPO / "docs" / "cli.md").read_text(encoding="utf-8")
    blocks = re.findall(r"```bash\n(.*?)```", doc, re.DOTALL)
    lines = [line.strip() for line in [*shown, *"".join(blocks).splitlines()]]
    return sorted({line for line in lines if line.startswith("kadapt apply ")})


POOLS = [line for line in _apply_examples() if "--num-blocks" in line]


def test_the_examples_that_size_a_pool_are_found() -> None:
    assert len(POOLS) >= 2  # apply --help's and docs/cli.md's step-graph examples


@pytest.mark.parametrize("example", POOLS)
def test_a_pool_in_an_example_holds_one_row(example: str) -> None:
    args = shlex.split(example)[2:]
    given = {
        flag: int(args[args.index(flag) + 1])
        for flag in ("--num-blocks", "--block-size", "--max-cache-len")
        if flag in args
    }
    spec = load_spec(resolve_spec_path(args[0]))
    assert spec.abi is not None
    block_size = given.get("--block-size", spec.abi.kv_cache.block_size)
    max_cache_len = given.get("--max-cache-len", spec.abi.max_cache_len)
    assert paged_size_problems(block_size, given["--num-blocks"], max_cache_len) == [], example


def test_the_example_engine_trace_prices() -> None:
    """``simulate --steps examples/engine_trace.json`` is an example of ``simulate --help`` and docs/cli.md:
    the file must exist and be a trace the command prices (it named a file nobody had)."""
    path = REPO / "examples" / "engine_trace.json"
    trace = json.loads(path.read_text(encoding="utf-8"))
    args = ["simulate", "llama", "--device", "h100", "--steps", str(path), "--format", "json"]
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 0, result.output
    priced = json.loads(result.stdout)
    assert len(priced["steps"]) == len(trace["steps"])
    assert priced["tokens"] == sum(row["query"] for step in trace["steps"] for row in step["rows"])
    assert {step["path"] for step in priced["steps"]} == {"decode", "prefill"}
