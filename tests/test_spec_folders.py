"""Folder-driven spec tests: every file in specs/valid must pass, every file in specs/invalid must
fail with exactly the errors its ``# expect: LINE:COL: BREADCRUMB: MESSAGE-SUBSTRING`` header lists
(``<root>`` stands for the empty breadcrumb of file-level problems), and every file in
specs/deprecated - a spec in a form an earlier release accepted - must pass with exactly the
deprecation warnings its ``# warn:`` header lists and load as the spec of the same name in specs/valid,
its new form."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from kimi_adapter_core.builtins import registry
from kimi_adapter_core.spec.loader import check_spec, load_spec

SPECS = Path(__file__).parent / "specs"
VALID = sorted((SPECS / "valid").glob("*.yaml"))
INVALID = sorted((SPECS / "invalid").glob("*.yaml"))
DEPRECATED = sorted((SPECS / "deprecated").glob("*.yaml"))
EXPECT = re.compile(r"^# expect: (\d+):(\d+): (\S+): (.+)$")
WARN = re.compile(r"^# warn: (\d+):(\d+): (\S+): (.+)$")
FAKE_BUILTINS = {
    name: (f"tests.fake:{name}", "test double")
    for name in ("mla_expand_kv_functional", "moe_zeros_like", "is_torch_fx_available", "meta_passthrough")
}


@pytest.fixture(autouse=True)
def fake_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A fixed catalogue, so these tests do not depend on which builtins exist today."""
    monkeypatch.setattr(registry, "BUILTINS", FAKE_BUILTINS)


def expectations(path: Path, header: re.Pattern[str] = EXPECT) -> list[tuple[int, int, str, str]]:
    found = []
    for line in path.read_text(encoding="utf-8").splitlines():
        match = header.match(line)
        if match:
            crumb = "" if match[3] == "<root>" else match[3]
            found.append((int(match[1]), int(match[2]), crumb, match[4]))
    return found


def test_folders_are_populated() -> None:
    assert len(VALID) >= 4
    assert len(INVALID) >= 15
    assert DEPRECATED


@pytest.mark.parametrize("path", VALID, ids=lambda p: p.name)
def test_valid_spec_has_no_diagnostics(path: Path) -> None:
    result = check_spec(path)
    assert [d.render() for d in result.diagnostics] == []
    spec = load_spec(path)
    assert spec.name == path.stem


@pytest.mark.parametrize("path", INVALID, ids=lambda p: p.name)
def test_invalid_spec_reports_exactly_the_expected_errors(path: Path) -> None:
    expected = expectations(path)
    assert expected, f"{path.name} has no '# expect:' header"
    errors = check_spec(path).errors
    rendered = [d.render() for d in errors]
    for line, col, crumb, text in expected:
        assert any(
            (d.line, d.col, d.breadcrumb) == (line, col, crumb) and text in d.message for d in errors
        ), f"expected {line}:{col}: {crumb or '<root>'}: {text}\ngot:\n" + "\n".join(rendered)
    assert len(errors) == len(expected), "unexpected extra errors:\n" + "\n".join(rendered)


@pytest.mark.parametrize("path", DEPRECATED, ids=lambda p: p.name)
def test_deprecated_spec_warns_and_loads_as_its_new_form(path: Path) -> None:
    """The old form validates - no error, exactly the warnings its header lists, each a deprecation -
    and ``load_spec`` returns what the new form (specs/valid/<same name>) loads, warnings carried."""
    expected = expectations(path, WARN)
    assert expected, f"{path.name} has no '# warn:' header"
    result = check_spec(path)
    assert [d.render() for d in result.errors] == []
    warnings = result.warnings
    rendered = "\n".join(d.render() for d in warnings)
    for line, col, crumb, text in expected:
        assert any(
            (d.line, d.col, d.breadcrumb) == (line, col, crumb) and text in d.message for d in warnings
        ), f"expected {line}:{col}: {crumb}: {text}\ngot:\n{rendered}"
    assert len(warnings) == len(expected), "unexpected extra warnings:\n" + rendered
    assert {d.code for d in warnings} == {"deprecated"}
    old, new = load_spec(path), load_spec(SPECS / "valid" / path.name)
    assert old.deprecations == tuple(d.render() for d in warnings) and new.deprecations == ()
    # the same spec but for where it lives (its config is the new form's file, named from another folder)
    assert old.source == new.source
    assert {**old.raw, "source": new.raw["source"]} == new.raw
    assert dataclasses.replace(old, path=new.path, raw=new.raw) == new
