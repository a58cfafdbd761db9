"""The benchmark figures docs/cost_model.md shows: regenerated from the benchmark, never typed.

A block of the doc between ``<!-- bench:NAME -->`` and ``<!-- /bench:NAME -->`` holds, in a text fence,
exactly what ``python benchmarks/bench_simulation.py --only NAME`` prints. A typed figure goes stale the
moment a pricing change moves it (the doc said the A3 16k decode was 0.88 and "all four meet the bars"
long after it had fallen to 0.77); a generated one cannot, because ``tests/test_doc_figures.py`` reruns
each section and fails on any difference.

Run: ``python benchmarks/doc_figures.py --write`` after a change that moves a figure (the test names
the block); without ``--write`` it lists the stale blocks and exits 1 when there are any.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # bench_simulation's sibling modules, as when it runs as a script

import bench_simulation  # noqa: E402

DOC = HERE.parent / "docs" / "cost_model.md"
BLOCK = re.compile(r"(<!-- bench:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /bench:(?P=name) -->)", re.DOTALL)


def render(name: str) -> str:
    """What ``bench_simulation.py --only NAME`` prints (no TensorCast checkout), as a doc block's body."""
    options = argparse.Namespace(tensorcast=None, tensorcast_python=None)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        bench_simulation.SECTIONS[name](options)
    return "```text\n" + printed.getvalue().strip("\n") + "\n```\n"


def blocks(text: str) -> dict[str, str]:
    """Each generated block of ``text``: its name and its current body."""
    return {m["name"]: m["body"] for m in BLOCK.finditer(text)}


def regenerate(text: str, rendered: dict[str, str]) -> str:
    """``text`` with each block named in ``rendered`` replaced by its rendered body."""

    def fresh(match: re.Match[str]) -> str:
        body = rendered.get(match["name"])
        return match[0] if body is None else f"{match[1]}{body}{match[4]}"

    return BLOCK.sub(fresh, text)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite the stale blocks of {DOC.name}")
    parser.add_argument("names", nargs="*", help="blocks to check or write (default: all)")
    options = parser.parse_args()
    text = DOC.read_text(encoding="utf-8")
    current = blocks(text)
    unknown = sorted(set(options.names) - set(current))
    if unknown:
        parser.error(f"no block {', '.join(unknown)} in {DOC.name} (its blocks: {', '.join(current)})")
    rendered = {name: render(name) for name in options.names or current}
    stale = [name for name, body in rendered.items() if current[name] != body]
    if options.write and stale:
        DOC.write_text(regenerate(text, {name: rendered[name] for name in stale}), encoding="utf-8")
        print(f"rewrote {', '.join(stale)} in {DOC}")
        return
    verdict = f"stale blocks: {', '.join(stale)}" if stale else "every block is current"
    print(f"{DOC.name}: {verdict}")
    sys.exit(1 if stale else 0)


if __name__ == "__main__":
    main()
