"""A pin reviewed against several transformers releases' sources (``pin:`` as a list, one entry per release).

DeepSeek-V4-Flash's three compressor builtins wrap forwards whose 5.23 and 5.24 sources differ (5.23 takes
the cache as ``past_key_values``): each pin lists both, and the patch applies where the installed source
matches any entry. ``kadapt pin --write`` adds the installed release's entry when none accepts it, keeping
the others; ``kadapt doctor`` names the entry that matched; the spec language refuses an entry apply could
never check (a release outside ``requires``, one listed twice, a target that is not transformers' code);
generated modules carry every entry and refuse code matching none. Run on both tested releases (compat):
the installed one's entry is real, the other's is the one a review of that release would add.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

import pytest
from click.testing import CliRunner
from test_cli_conventions import deepseek_copy

from kimi_adapter_core.cli import cli
from kimi_adapter_core.cli.doctor import pin_findings
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied
from kimi_adapter_core.patching import pins, portable
from kimi_adapter_core.patching.ledger import APPLIED
from kimi_adapter_core.spec import load_spec

pytestmark = pytest.mark.compat

INSTALLED = metadata.version("transformers")
OTHER = "5.24.0" if INSTALLED.startswith("5.23") else "5.23.0"  # the other tested release
K1_PIN = (
    '    pin:\n      signature: "(self, kv_nope: torch.Tensor, k_rot: torch.Tensor) -> tuple[torch.Tensor, '
    'torch.Tensor]"\n'
    '      source_sha256: "a00ce9f72a807221f67dce8c739e1aa7a2122cc242b1eb743cee0c1c9f22aa6a"\n'
)
STALE = "0" * 64


def _per_release(tmp_path: Path, *entries: tuple[str, str]) -> Path:
    """specs/deepseek_v3.yaml with K1 (``expand_kv``) pinned per release: ``(release, source_sha256)``."""
    spec = deepseek_copy(tmp_path)
    text = spec.read_text(encoding="utf-8")
    assert K1_PIN in text
    listed = "".join(f'      - transformers: "{r}"\n        source_sha256: "{sha}"\n' for r, sha in entries)
    spec.write_text(text.replace(K1_PIN, f"    pin:\n{listed}"), encoding="utf-8")
    return spec


def _expand_kv_sha256() -> str:
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    return portable.source_sha256(DeepseekV3Attention.expand_kv)


def test_pin_write_adds_the_installed_releases_entry_and_keeps_the_others(tmp_path: Path) -> None:
    """Only another release's source pinned: apply refuses, naming it; ``kadapt pin --write`` adds the
    installed release's entry (the fields the others pin, in release order) and the patch applies."""
    spec = _per_release(tmp_path, (OTHER, STALE))
    with pytest.raises(KadaptError) as refused:
        with applied(load_spec(spec), backend="extraction"):
            pass
    text = str(refused.value)
    assert "no longer matches any of its pins" in text and f"against its transformers {OTHER} pin" in text
    assert f"source_sha256 found    {_expand_kv_sha256()}" in text
    assert refused.value.location == load_spec(spec).locate("patches[0]")
    stale = CliRunner().invoke(cli, ["pin", str(spec)])
    assert stale.exit_code == 1 and f'+      - transformers: "{INSTALLED}"' in stale.output
    assert CliRunner().invoke(cli, ["pin", str(spec), "--write"]).exit_code == 0
    written = load_spec(spec).patches[0]
    expected = {OTHER: STALE, INSTALLED: _expand_kv_sha256()}
    assert [p.release for p in written.pins] == sorted(expected, key=lambda r: tuple(map(int, r.split("."))))
    assert {p.release: p.source_sha256 for p in written.pins} == expected
    assert all(p.signature is None for p in written.pins)  # the other entries pin no signature
    with applied(load_spec(spec), backend="extraction") as ledger:
        assert ledger.status_of("K1") == APPLIED
    again = CliRunner().invoke(cli, ["pin", str(spec)])
    assert again.exit_code == 0 and "1 pins up to date" in again.output


def test_an_entry_accepting_the_installed_source_is_up_to_date(tmp_path: Path) -> None:
    """The installed source matches one entry: nothing to review, ``kadapt pin`` leaves the spec as it is
    (whichever release's entry accepted it)."""
    spec = _per_release(tmp_path, (OTHER, _expand_kv_sha256()))
    before = spec.read_text(encoding="utf-8")
    result = CliRunner().invoke(cli, ["pin", str(spec), "--write"])
    assert result.exit_code == 0 and spec.read_text(encoding="utf-8") == before
    patch = load_spec(spec).patches[0]
    assert pins.matching(patch.pins, _resolve(patch.target)) == patch.pins[0]


def _resolve(target: str):  # noqa: ANN202 - the target's function
    from kimi_adapter_core.patching.targets import import_module, parse_target, resolve_in

    ref = parse_target(target)
    return resolve_in(ref, import_module(ref)).function()


def test_the_spec_language_refuses_entries_apply_could_never_check(tmp_path: Path) -> None:
    """A release outside ``requires`` (apply refuses the spec there), one listed twice, one that is no
    PEP 440 version, and a per-release pin on code that is not transformers', each at its line."""
    spec = _per_release(tmp_path, ("5.22.0", STALE), (INSTALLED, STALE), (INSTALLED, STALE), ("five", STALE))
    text = spec.read_text(encoding="utf-8")
    spec.write_text(text.replace("transformers.models.deepseek_v3.modeling_deepseek_v3:", "kadapt_toy:"))
    result = CliRunner().invoke(cli, ["validate", str(spec)])
    assert result.exit_code == 1
    found = {}  # breadcrumb -> message, each finding at the spec's file, line and column
    for line in result.output.splitlines():
        if ": patches[0].pin" in line:
            where, breadcrumb, message = line.split(": ", 2)
            assert where.startswith(f"{spec}:") and where.rsplit(":", 2)[1].isdigit()
            found[breadcrumb] = message
    assert "outside the spec's requires range '>=5.23,<6'" in found["patches[0].pin[0].transformers"]
    assert "pinned twice (first line" in found["patches[0].pin[2].transformers"]
    assert "'five' is not a PEP 440 release" in found["patches[0].pin[3].transformers"]
    assert "kadapt_toy:DeepseekV3Attention.expand_kv is not transformers' code" in found["patches[0].pin"]


def test_generated_modules_accept_any_reviewed_source_and_refuse_others() -> None:
    """The embedded check (``portable.check_pin``) takes every entry: a function matching one is patched,
    one matching none is refused with each release's pinned and found hash."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    function, sha = DeepseekV3Attention.expand_kv, _expand_kv_sha256()
    portable.check_pin("K1", "expand_kv", function, ((OTHER, None, STALE), (INSTALLED, None, sha)))
    portable.check_pin("K1", "expand_kv", function, ((None, None, sha),))  # the one-source form
    with pytest.raises(
        RuntimeError, match=rf"pinned {STALE} for {OTHER}, found {sha}.*pinned {STALE} for 5.22"
    ):
        portable.check_pin("K1", "expand_kv", function, ((OTHER, None, STALE), ("5.22.0", None, STALE)))


def test_deepseek_v4_flash_pins_match_the_installed_release() -> None:
    """The shipped Flash spec applies on both tested releases: doctor finds each compressor's pin matched by
    the installed release's own entry."""
    rows = [row for row in pin_findings() if row["spec"] == "deepseek_v4_flash"]
    assert [row["id"] for row in rows] == ["V1", "V2", "V3"]
    assert all(row["status"] == "ok" for row in rows), rows
    assert {row["found"] for row in rows} == {f"matches its transformers {INSTALLED} pin"}
    releases = {tuple(p.release for p in patch.pins) for patch in load_spec("deepseek_v4_flash").patches}
    assert releases == {("5.23.0", "5.24.0")}
