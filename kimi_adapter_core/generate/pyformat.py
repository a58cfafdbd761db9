"""Make generated Python look hand-written: imports sorted and code formatted by ruff, then compiled.

ruff runs ``--isolated`` with explicit settings so that the output depends only on the rendered
text, never on whichever ``pyproject.toml`` happens to sit above the output directory. It works on
a file in a private temp directory: nothing under the output directory is touched until every
target rendered.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

from ..errors import KadaptError

LINE_LENGTH = 110
TARGET_VERSION = "py310"
_COMMON = ["--isolated", "--line-length", str(LINE_LENGTH), "--target-version", TARGET_VERSION]


def _ruff(args: list[str], path: Path, what: str) -> None:
    if importlib.util.find_spec("ruff") is None:
        raise KadaptError(
            f"cannot format {what}: ruff is not installed (it comes with the model extra: "
            "`pip install 'kadapt[model]'`)"
        )
    proc = subprocess.run(
        [sys.executable, "-m", "ruff", *args, *_COMMON, str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
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
