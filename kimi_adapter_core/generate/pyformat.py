"""Make generated Python look hand-written: imports sorted and code formatted by ruff, then compiled.

ruff runs ``--isolated`` with explicit settings so that the output depends only on the rendered
text, never on whichever ``pyproject.toml`` happens to sit above the output directory. It works on
a file in a private temp directory: nothing under the output directory is touched until every
target rendered.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import KadaptError

LINE_LENGTH = 110
TARGET_VERSION = "py310"
_COMMON = ["--isolated", "--line-length", str(LINE_LENGTH), "--target-version", TARGET_VERSION]


@functools.cache
def _ruff_command() -> tuple[str, ...]:
    """The ruff binary itself, found as ``python -m ruff`` finds it: two runs per generated file, and
    a Python start-up each (~30 ms) cost more than ruff's own work. Where that lookup is missing or
    fails, ``python -m ruff``, so that a broken install reports as it always did."""
    try:
        from ruff.__main__ import find_ruff_bin

        return (os.fsdecode(find_ruff_bin()),)  # older ruff returns a Path
    except (ImportError, OSError):  # no such helper, or no binary where it looks (RuffNotFound)
        return (sys.executable, "-m", "ruff")


def _ruff(args: list[str], path: Path, what: str) -> None:
    if importlib.util.find_spec("ruff") is None:
        raise KadaptError(
            f"cannot format {what}: ruff is not installed (it comes with the model extra: "
            "`pip install 'kadapt[model]'`)"
        )
    try:
        proc = subprocess.run(
            [*_ruff_command(), *args, *_COMMON, str(path)],
            capture_output=True,
            text=True,
            check=False,
        )
    except OSError as exc:  # a binary that will not start: what `python -m ruff` reported as its failure
        raise KadaptError(f"ruff failed on generated {what}: {exc}") from exc
    if proc.returncode != 0:
        detail = (proc.stderr or proc.stdout).strip().replace(str(path), what)
        raise KadaptError(f"ruff failed on generated {what}: {detail}")


def format_python(source: str, what: str) -> str:
    """Return ``source`` with sorted imports and ruff formatting; raise if it does not compile.

    ``what`` names the output file in error messages (e.g. ``adapters/kimi_k25/extraction.py``).
    """
    _compile(source, what)  # a syntax error reads better against the unformatted render
    with tempfile.TemporaryDirectory(prefix="kadapt-fmt-") as tmp:
        path = Path(tmp) / "generated.py"
        path.write_text(source, encoding="utf-8")
        _ruff(["check", "--select", "I", "--fix", "--quiet", "--exit-zero"], path, what)
        _ruff(["format", "--quiet"], path, what)
        formatted = path.read_text(encoding="utf-8")
    _compile(formatted, what)
    return formatted


def _compile(source: str, what: str) -> None:
    try:
        compile(source, what, "exec", dont_inherit=True)
    except SyntaxError as exc:
        raise KadaptError(f"generated {what} does not compile: {exc.msg} (line {exc.lineno})") from exc
