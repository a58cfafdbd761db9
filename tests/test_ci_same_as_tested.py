"""``.ci/same_as_tested.py``: the newest-release compat run is skipped only when the unconstrained
install is the tested set exactly."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("same_as_tested", REPO / ".ci" / "same_as_tested.py")
assert spec is not None and spec.loader is not None
same_as_tested = importlib.util.module_from_spec(spec)
spec.loader.exec_module(same_as_tested)


def test_pins_normalize_names_and_drop_local_labels() -> None:
    lines = ["# torch==9", "Foo_Bar.baz==1.0+cpu", "plain==2", "not a pin"]
    assert same_as_tested.pins(lines) == {"foo-bar-baz": "1.0", "plain": "2"}


def test_only_the_exact_set_counts_as_tested(tmp_path: Path, capsys) -> None:
    frozen = subprocess.run(
        [sys.executable, "-m", "pip", "freeze", "--exclude-editable"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    exact = tmp_path / "exact.txt"
    exact.write_text(frozen)
    assert same_as_tested.main(str(exact)) == 0
    name, version = next(line for line in frozen.splitlines() if "==" in line).split("==", 1)
    moved = tmp_path / "moved.txt"
    moved.write_text(frozen.replace(f"{name}=={version}", f"{name}==0.0.0.dev0"))
    assert same_as_tested.main(str(moved)) == 1
    assert "tested 0.0.0.dev0" in capsys.readouterr().out
