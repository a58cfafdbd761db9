"""A spec's ``requires`` is checked against the installed releases before anything is applied."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import transformers
from click.testing import CliRunner

from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.requirements import unmet

REPO = Path(__file__).resolve().parents[1]


def llama_requiring(tmp_path: Path, transformers_range: str) -> Path:
    """The shipped llama spec, copied with another transformers requirement."""
    shutil.copytree(REPO / "specs" / "llama", tmp_path / "llama")
    text = (REPO / "specs" / "llama.yaml").read_text(encoding="utf-8")
    assert 'transformers: ">=5.23,<6"' in text
    path = tmp_path / "llama.yaml"
    path.write_text(text.replace('transformers: ">=5.23,<6"', f'transformers: "{transformers_range}"'))
    return path


def test_apply_refuses_a_spec_for_other_releases_at_its_requires_line(tmp_path: Path) -> None:
    path = llama_requiring(tmp_path, "<5")
    assert unmet(load_spec(path)) == [("transformers", "<5", transformers.__version__)]
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["apply", str(path), "--output-dir", str(out)])
    assert result.exit_code == 1
    line = next(i for i, text in enumerate(path.read_text().splitlines(), 1) if "transformers:" in text)
    assert f"llama.yaml:{line}:" in result.output
    assert f"spec llama requires transformers<5 (installed: {transformers.__version__})" in result.output
    assert "Traceback" not in result.output and not out.exists()  # refused before any work
    assert CliRunner().invoke(cli, ["validate", str(path)]).exit_code == 0  # a valid spec, elsewhere


def test_nothing_is_patched_when_the_requirement_is_unmet(tmp_path: Path) -> None:
    import transformers.models.llama.modeling_llama as llama

    before = dict(vars(llama.LlamaAttention))
    with (
        pytest.raises(KadaptError, match="requires transformers<5"),
        applied(llama_requiring(tmp_path, "<5")),
    ):
        pass
    assert dict(vars(llama.LlamaAttention)) == before


def test_a_satisfied_range_applies(tmp_path: Path) -> None:
    path = llama_requiring(tmp_path, f">={transformers.__version__}")
    assert unmet(load_spec(path)) == []
    with applied(path) as ledger:
        assert ledger.entries


def test_doctor_does_not_check_the_pins_of_a_spec_for_other_releases(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A spec whose ``requires`` the installed release misses has its pins listed as not checked, with
    the range; the others' pins are checked. Every shipped spec takes 5.23 and 5.24 now: a copy of
    Llama-4 Scout's reviewed for 5.24 alone stands in, with 5.23 installed."""
    for name in ("kimi_k25", "llama4_scout"):
        shutil.copytree(REPO / "specs" / name, tmp_path / name)
        shutil.copy(REPO / "specs" / f"{name}.yaml", tmp_path / f"{name}.yaml")
    scout = tmp_path / "llama4_scout.yaml"
    text = scout.read_text(encoding="utf-8")
    assert 'transformers: ">=5.23,<6"' in text
    text = re.sub(r'      - transformers: "5\.23\.0"\n(?:        .*\n)+', "", text)
    scout.write_text(text.replace('transformers: ">=5.23,<6"', 'transformers: ">=5.24,<6"'))
    monkeypatch.setattr("kimi_adapter_core.resources.shipped_dir", lambda name: tmp_path)
    monkeypatch.setattr(
        "kimi_adapter_core.spec.requirements.metadata.version",
        lambda package: "5.23.0" if package == "transformers" else "2.13.0",
    )
    rows = {
        (r["spec"], r["id"]): r
        for r in json.loads(CliRunner().invoke(cli, ["doctor", "--format", "json"]).stdout)["pins"]
    }
    assert rows["llama4_scout", "L1"]["status"] == "not checked"
    assert (
        rows["llama4_scout", "L1"]["found"] == "the spec requires transformers>=5.24,<6 (installed: 5.23.0)"
    )
    assert rows["kimi_k25", "K1"]["status"] == "ok"
