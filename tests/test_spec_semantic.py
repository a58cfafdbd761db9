"""Semantic checks and the ``load_spec`` contract that the rest of kadapt relies on."""

from __future__ import annotations

from pathlib import Path

import pytest

from kimi_adapter_core.builtins import registry
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.diagnostics import Severity, SpecInvalid
from kimi_adapter_core.spec.loader import check_spec

REPO = Path(__file__).resolve().parents[1]
SHA = "0123456789abcdef0123456789abcdef01234567"
SOURCE = "source:\n  config: config.json\n"
PATCH = SOURCE + "patches:\n  - id: P1\n    why: x\n    target: a:B.c\n"


def write_spec(tmp_path: Path, body: str, config: str = '{"model_type": "toy"}') -> Path:
    (tmp_path / "config.json").write_text(config, encoding="utf-8")
    path = tmp_path / "spec.yaml"
    header = "apiVersion: kadapt/v1\nkind: AdapterSpec\nmetadata:\n  name: toy\ngate:\n  model_type: toy\n"
    path.write_text(header + body, encoding="utf-8")
    return path


def test_branch_revision_is_a_warning_and_still_loads(tmp_path: Path) -> None:
    body = SOURCE + "  hub:\n    repo: a/b\n    revision: main\n"
    path = write_spec(tmp_path, body)
    [diag] = check_spec(path).diagnostics
    assert (diag.severity, diag.breadcrumb, diag.line) == (Severity.WARNING, "source.hub.revision", 11)
    assert diag.render().endswith("source.hub.revision: warning: " + diag.message)
    assert load_spec(path).source.hub.revision == "main"


def test_commit_sha_revision_is_clean(tmp_path: Path) -> None:
    path = write_spec(tmp_path, f"source:\n  hub:\n    repo: a/b\n    revision: {SHA}\n")
    assert check_spec(path).diagnostics == ()


def test_load_spec_raises_one_error_listing_everything(tmp_path: Path) -> None:
    path = write_spec(tmp_path, PATCH + "    kind: nope\nabi: 3\n")
    with pytest.raises(SpecInvalid) as caught:
        load_spec(path)
    assert isinstance(caught.value, KadaptError)
    text = str(caught.value)
    assert text.startswith("invalid spec (2 errors):")
    assert f"{path}:13:5: patches[0].kind: 'nope' is not one of: replace" in text
    assert f"{path}:14:1: abi: expected mapping, got integer 3" in text


def test_spec_positions_locate_nodes(tmp_path: Path) -> None:
    spec = load_spec(write_spec(tmp_path, PATCH + "    kind: meta_stub\n"))
    assert spec.positions["patches[0].target"] == (12, 5)
    assert spec.locate(spec.patches[0].where) == f"{spec.path}:10:5"


def test_builtins_are_read_at_validation_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_spec(tmp_path, PATCH + "    kind: replace\n    impl: builtin:fresh_one\n")
    monkeypatch.setattr(registry, "BUILTINS", {})
    [diag] = check_spec(path).errors
    assert "no builtins are registered" in diag.message
    monkeypatch.setattr(registry, "BUILTINS", {"fresh_one": ("m:f", "new")})
    assert check_spec(path).errors == []


def test_large_catalogue_only_suggests(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_spec(tmp_path, PATCH + "    kind: replace\n    impl: builtin:name_07x\n")
    monkeypatch.setattr(registry, "BUILTINS", {f"name_{i:02}": ("m:f", "s") for i in range(40)})
    [diag] = check_spec(path).errors
    assert "did you mean 'name_07'?" in diag.message
    assert "known builtins" not in diag.message


def test_schema_invalid_entries_are_not_checked_twice(tmp_path: Path) -> None:
    """A bridge with a schema error is skipped by the path checks (one mistake, one message)."""
    body = "config_bridges:\n  - id: B1\n    why: x\n    op: rename\n    from: missing\n"
    [diag] = check_spec(write_spec(tmp_path, SOURCE + body)).errors
    assert diag.message == "missing required key 'to' when op is rename"


def test_verify_needs_room_for_decode_steps(tmp_path: Path) -> None:
    body = (
        f"{SOURCE}backends:\n  extraction:\n    file_prefix: t\n    output_dir: o\n"
        "    weight_renames: [{from: '(', to: x}]\n"
        "    verify: {prefill_len: 8, max_cache_len: 16, decode_steps: 9}\n"
    )
    codes = sorted(d.code for d in check_spec(write_spec(tmp_path, body)).errors)
    assert codes == ["verify-lengths", "weight-rename-regex"]


def test_moe_key_may_come_from_a_bridge(tmp_path: Path) -> None:
    config = '{"model_type": "toy", "text_config": {"n_routed_experts": 4}}'
    bridge = (
        "config_bridges:\n  - id: B1\n    why: x\n    op: copy\n    from: text_config.n_routed_experts\n"
        "    to: n_routed_experts\n"
    )
    moe = "moe:\n  moe_class: M\n  num_experts_key: n_routed_experts\n"
    assert check_spec(write_spec(tmp_path, SOURCE + bridge + moe, config)).errors == []
    [diag] = check_spec(write_spec(tmp_path, SOURCE + moe, config)).errors
    assert diag.code == "moe-experts-key"


@pytest.mark.parametrize("name", ["kimi_k25.yaml", "kimi_k25_remote.yaml"])
def test_shipped_specs_are_clean(name: str) -> None:
    result = check_spec(REPO / "specs" / name)
    assert [d.render() for d in result.errors + result.warnings] == []


def test_alternatives_report_inside_the_branch_that_fits(tmp_path: Path) -> None:
    """num_experts_key is a string or a list: a bad list item is reported at the item."""
    path = write_spec(tmp_path, SOURCE + "moe:\n  moe_class: M\n  num_experts_key: [text_config, 7]\n")
    [diag] = check_spec(path).errors
    assert (diag.breadcrumb, diag.message) == ("moe.num_experts_key[1]", "expected string, got integer 7")
