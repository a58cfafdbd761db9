"""``kadapt apply`` tunes the garbage collector for its run and gives it back (``cli/collector.py``)."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
from click.testing import CliRunner

from kimi_adapter_core.backends import extraction
from kimi_adapter_core.cli import cli
from kimi_adapter_core.cli.collector import FULL_COLLECTION_EVERY
from kimi_adapter_core.errors import KadaptError

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("outcome", ["returns", "fails"])
def test_the_built_model_is_frozen_during_the_run_and_everything_is_given_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, outcome: str
) -> None:
    seen: dict[str, object] = {}

    def extract(spec, model, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003 - stands in for run_cached
        seen["full"] = gc.get_threshold()[2]
        seen["frozen"] = gc.get_freeze_count()
        # the permanent generation is not listed
        seen["model collected"] = any(o is model for o in gc.get_objects())
        raise KadaptError("stop here") if outcome == "fails" else SystemExit(0)

    monkeypatch.setattr(extraction, "run_cached", extract)
    suite = gc.get_threshold()  # conftest's
    gc.set_threshold(700, 10, 10)  # CPython's default, which the command must give back
    before = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    try:
        result = CliRunner().invoke(
            cli, ["apply", str(REPO / "specs" / "llama.yaml"), "--output-dir", str(tmp_path / "out"), "-q"]
        )
        after = gc.get_threshold()
    finally:
        gc.set_threshold(*suite)
    assert result.exit_code == (1 if outcome == "fails" else 0), result.output
    assert seen["full"] == max(before[2], FULL_COLLECTION_EVERY)  # tuned while the run ran
    assert seen["frozen"] > 10_000 and not seen["model collected"]  # the imports and the built model
    assert after == before  # and given back, even when the run failed
    assert gc.get_freeze_count() == 0
