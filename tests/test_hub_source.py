"""``source.hub``: the config comes from the hub at the spec's pinned revision, never a moving branch.

No machine here reaches the hub, so the tests fill an offline Hugging Face cache the way a previous
download would have (``models--org--name/snapshots/<sha>/config.json``) and run with the hub client
offline: exactly what ``hf_hub_download`` sees on a machine that fetched the revision before.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.spec_files import REPO, TINY_KIMI, tiny_kimi_config

from kimi_adapter_core.cli import cli

REPO_ID = "kadapt-test/tiny-kimi"
SHA = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = cache / f"models--{REPO_ID.replace('/', '--')}" / "snapshots" / SHA
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(tiny_kimi_config()), encoding="utf-8")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def hub_spec(tmp_path: Path, revision: str) -> Path:
    """specs/kimi_k25.yaml with its shipped config replaced by a hub source at ``revision``."""
    text = (REPO / "specs" / "kimi_k25.yaml").read_text(encoding="utf-8")
    head, rest = text.split("source:\n", 1)
    rest = rest[rest.index("\nrequires:") :]
    source = f"source:\n  hub:\n    repo: {REPO_ID}\n    revision: {revision}\n  trust_remote_code: false\n"
    spec = tmp_path / "hub_kimi.yaml"
    spec.write_text(head + source + rest, encoding="utf-8")
    return spec


def apply(*args: str):
    return CliRunner().invoke(cli, ["apply", *args], catch_exceptions=False)


def test_from_hub_loads_the_pinned_revision(tmp_path: Path, hub_cache: Path) -> None:
    result = apply(str(hub_spec(tmp_path, SHA)), "--from-hub", "--backend", "none", "--format", "json")
    assert result.exit_code == 0, result.output
    model = json.loads(result.stdout)["model"]
    # the tiny sizes can only have come from the cached hub snapshot, not the shipped full config
    assert model["layers"] == TINY_KIMI["text_config.num_hidden_layers"]
    assert model["experts"] == TINY_KIMI["text_config.n_routed_experts"]


def test_a_revision_that_was_never_fetched_is_a_clear_error(tmp_path: Path, hub_cache: Path) -> None:
    other = "f" * 40
    result = apply(str(hub_spec(tmp_path, other)), "--from-hub", "--backend", "none")
    assert result.exit_code == 1
    assert f"cannot download config.json of {REPO_ID}@{other}" in result.output
    assert "Traceback" not in result.output


def test_a_spec_without_a_shipped_config_says_where_to_load_from(tmp_path: Path) -> None:
    result = apply(str(hub_spec(tmp_path, SHA)), "--backend", "none")
    assert result.exit_code == 1
    assert "ships no config" in result.output and "hub_kimi.yaml" in result.output
