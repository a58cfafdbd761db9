"""``kadapt`` ends without the interpreter's teardown (``cli._leave``), but as ``sys.exit`` would:
the same status, every line written, every ``atexit`` handler run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}  # a pipe is block-buffered
SCRIPT = """
import atexit, sys
atexit.register(lambda: print("atexit handler ran", file=sys.stderr))
atexit.register(lambda: sys.stdout.write("unflushed"))  # block-buffered in a pipe: needs the flush
from kimi_adapter_core.cli import main
sys.argv = ["kadapt", *sys.argv[1:]]
main()
print("never reached", file=sys.stderr)
"""


@pytest.mark.parametrize(
    ("args", "status", "says"),
    [
        (["validate", str(REPO / "specs" / "llama.yaml")], 0, "1 spec checked, 0 invalid"),
        (["validate", str(REPO / "specs" / "no_such.yaml")], 2, "error: no spec file"),
        (["apply", "--no-such-option"], 2, "No such option"),
        (["--help"], 0, "Commands:"),
    ],
)
def test_the_status_the_output_and_the_atexit_handlers_are_sys_exits(
    args: list[str], status: int, says: str
) -> None:
    ran = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, cwd=REPO, env=BUFFERED
    )
    assert ran.returncode == status, ran.stderr
    assert says in ran.stdout + ran.stderr
    assert ran.stderr.rstrip().endswith("atexit handler ran")  # after the command's own output
    assert ran.stdout.endswith("unflushed")
    assert "never reached" not in ran.stderr and "Traceback" not in ran.stderr


def test_a_large_piped_output_arrives_whole() -> None:
    """``kadapt schema`` (49 kB) through a pipe arrives whole."""
    ran = subprocess.run(
        [sys.executable, "-m", "kimi_adapter_core", "schema"], capture_output=True, text=True, env=BUFFERED
    )
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout)["$schema"]  # a complete JSON document, not a cut-off one
