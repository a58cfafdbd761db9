"""The positioned YAML loader: positions per breadcrumb, and refusal of unsafe or ambiguous YAML."""

from __future__ import annotations

from pathlib import Path

from kimi_adapter_core.spec.loader import check_spec
from kimi_adapter_core.spec.yaml_loader import load_yaml, load_yaml_bytes

DOC = b"""\
a: 1
items:
  - id: X
    target: m:C.f
  - [1, two]
when: 2024-01-01
nothing: null
"""


def test_builds_plain_data_with_positions() -> None:
    loaded = load_yaml_bytes(DOC, "doc.yaml")
    assert loaded.diagnostics == []
    assert loaded.data == {
        "a": 1,
        "items": [{"id": "X", "target": "m:C.f"}, [1, "two"]],
        "when": "2024-01-01",  # dates stay text
        "nothing": None,
    }
    assert loaded.positions[""] == (1, 1)
    assert loaded.positions["items"] == (2, 1)
    assert loaded.positions["items[0]"] == (3, 5)
    assert loaded.positions["items[0].target"] == (4, 5)
    assert loaded.positions["items[1][1]"] == (5, 9)


def test_duplicate_key_names_first_occurrence() -> None:
    loaded = load_yaml_bytes(b"a:\n  b: 1\n  c: 2\n  b: 3\n", "d.yaml")
    [diag] = loaded.diagnostics
    assert (diag.line, diag.col, diag.breadcrumb, diag.code) == (4, 3, "a.b", "duplicate-key")
    assert "first defined on line 2" in diag.message


def test_python_tag_is_reported_not_constructed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    text = f"a:\n  - !!python/object/apply:os.system ['touch {marker}']\n".encode()
    [diag] = load_yaml_bytes(text, "t.yaml").diagnostics
    assert (diag.line, diag.col, diag.breadcrumb, diag.code) == (2, 5, "a[0]", "yaml-tag")
    assert not marker.exists()


def test_local_tags_merge_keys_and_non_string_keys_are_refused() -> None:
    text = b"base: &b {x: 1}\nuse:\n  <<: *b\nv: !custom 3\n1: one\n"
    codes = {(d.line, d.code) for d in load_yaml_bytes(text, "t.yaml").diagnostics}
    assert codes == {(3, "yaml-merge"), (4, "yaml-tag"), (5, "yaml-key")}


def test_recursive_alias_is_an_error_not_a_hang() -> None:
    [diag] = load_yaml_bytes(b"a: &x [1, *x]\n", "t.yaml").diagnostics
    assert diag.code == "yaml-alias"


def test_non_utf8_is_located(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("apiVersion: kadapt/v1\nmetadata:\n  name: caf\u00e9\n".encode("latin-1"))
    [diag] = check_spec(path).diagnostics
    assert (diag.line, diag.col, diag.code) == (3, 12, "encoding")
    assert "UTF-8" in diag.message


def test_zero_byte_file_is_empty(tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_bytes(b"")
    [diag] = load_yaml(path).diagnostics
    assert (diag.line, diag.col, diag.code) == (1, 1, "empty")


def test_utf8_bom_is_accepted() -> None:
    loaded = load_yaml_bytes("\ufeffa: b\n".encode(), "bom.yaml")
    assert loaded.diagnostics == [] and loaded.data == {"a": "b"}


def test_unreadable_path_is_a_diagnostic(tmp_path: Path) -> None:
    [diag] = load_yaml(tmp_path / "nope.yaml").diagnostics
    assert diag.code == "io"
