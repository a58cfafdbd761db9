"""Nothing a user sees of a shipped spec changes unless a commit means it to (issue 35).

Every shipped spec's artifacts (read from the suite's shared full-size run), its plan and two
simulations are digested the way ``tests/user_outputs.py`` recorded them; generated modules and docs
are compared by ``kadapt generate --check`` in ``test_generate``. A mismatch names the output that
changed: if the change is meant, re-record with ``python tests/user_outputs.py --write`` in the same
commit and say why in its message.
"""

from __future__ import annotations

import json

import pytest
from user_outputs import RECORD, SIMULATIONS, SPECS, artifact_digests, cli_invoke, command_digests

RECORDED: dict[str, str] = json.loads(RECORD.read_text())


def _under(key: str, prefix: str) -> bool:
    """``prefix`` names one output, or a folder of them when it ends with '/' (so plan/deepseek_v3 is
    not plan/deepseek_v32)."""
    return key == prefix or (prefix.endswith("/") and key.startswith(prefix))


def _changed(found: dict[str, str], prefix: str) -> list[str]:
    """Outputs under ``prefix`` whose digest differs from the record (or that only one side has)."""
    found = {k: v for k, v in found.items() if _under(k, prefix)}
    expected = {k: v for k, v in RECORDED.items() if _under(k, prefix)}
    return sorted(k for k in found.keys() | expected.keys() if found.get(k) != expected.get(k))


@pytest.mark.parametrize("spec", SPECS)
def test_artifacts_are_the_recorded_bytes(spec: str, shipped_apply) -> None:
    run = shipped_apply(spec)
    assert run.exit_code == 0, run.output
    assert _changed(artifact_digests(spec, run.files()), f"artifacts/{spec}/") == []


@pytest.mark.parametrize("spec", SPECS)
def test_plan_and_simulations_are_the_recorded_bytes(spec: str) -> None:
    found = command_digests(cli_invoke, [spec])
    assert _changed(found, f"plan/{spec}") + _changed(found, f"simulate/{spec}/") == []
    assert len(found) == 1 + len(SIMULATIONS)


def test_the_record_covers_every_spec_and_output() -> None:
    kinds = {key.split("/")[0] for key in RECORDED}
    assert kinds == {"artifacts", "plan", "simulate"}
    assert {key.split("/")[1] for key in RECORDED} == set(SPECS)
