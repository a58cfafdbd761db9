"""The extraction cache (``backends/extraction/job/cache.py``): a second ``kadapt apply`` with the same
inputs writes the same bytes without tracing, any changed input extracts again, and a damaged or
unwritable cache never changes what a run produces."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.job import cache_key
from kimi_adapter_core.backends.extraction.job.cache import ExtractionCache
from kimi_adapter_core.backends.extraction.job.cache_key import (
    Uncacheable,
    canonical,
    library_digest,
    run_key,
)
from kimi_adapter_core.cli import cli
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
LLAMA = REPO / "specs" / "llama.yaml"
DEEPSEEK = REPO / "specs" / "deepseek_v3.yaml"  # its K1 patch is reached by the export: the ledger says so
CONFIG = json.loads((REPO / "specs" / "llama" / "config.json").read_text(encoding="utf-8"))


def apply(out: Path, *extra: str, spec: Path = LLAMA) -> dict[str, Any]:
    result = CliRunner().invoke(
        cli,
        ["apply", str(spec), "--output-dir", str(out), "--format", "json", *extra],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def entries(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if not p.name.startswith("."))


def report(doc: dict[str, Any]) -> dict[str, Any]:
    """What a run says besides timing, cache use and its directory: equal for a hit and a cold run."""
    extraction = {k: v for k, v in doc["extraction"].items() if k not in ("steps", "seconds", "cache")}
    for item in [*extraction["graphs"].values(), extraction["kv_mapping"], extraction["weight_map"]]:
        item["path"] = Path(item["path"]).name
    return {**doc, "extraction": extraction}


def test_second_run_restores_the_same_bytes_and_report(tmp_path, _private_extraction_cache):
    cold = apply(tmp_path / "a", spec=DEEPSEEK)
    assert cold["extraction"]["cache"]["stored"] is True
    assert len(entries(_private_extraction_cache)) == 1

    warm = apply(tmp_path / "b", spec=DEEPSEEK)
    assert warm["extraction"]["cache"]["hit"] is True
    assert warm["extraction"]["cache"]["key"] == cold["extraction"]["cache"]["key"]
    assert [s["step"] for s in warm["extraction"]["steps"]] == ["restore from cache"]

    uncached = apply(tmp_path / "c", "--no-cache", spec=DEEPSEEK)  # extracts, into a third directory
    assert uncached["extraction"]["cache"] == {"hit": False, "stored": False, "reason": "--no-cache"}
    assert len(entries(_private_extraction_cache)) == 1

    # byte for byte, wherever written: no artifact names its directory, so one entry serves any
    assert files(tmp_path / "a") == files(tmp_path / "b") == files(tmp_path / "c")
    # the ledger (with each patch's reach from the export) and the graph statistics come back too
    assert report(warm) == report(cold) == report(uncached)
    reached = [e for e in warm["ledger"]["entries"] if e.get("reached")]
    assert [e["id"] for e in reached] == ["K1"]


def test_text_summary_says_restored_not_extracted_on_a_hit(tmp_path, _private_extraction_cache):
    """A hit traces nothing: its summary line must not claim an extraction (it did, at 0.2 s)."""

    def summary(out: Path) -> list[str]:
        result = CliRunner().invoke(
            cli, ["apply", str(LLAMA), "--output-dir", str(out)], catch_exceptions=False
        )
        assert result.exit_code == 0, result.output
        return [
            line for line in result.stdout.splitlines() if line.startswith(("extracted ", "restored llama"))
        ]

    assert [line.split(" (")[0] for line in summary(tmp_path / "a")] == ["extracted llama"]
    assert [line.split(" (")[0] for line in summary(tmp_path / "b")] == ["restored llama"]


def test_doctor_reports_the_cache(tmp_path, _private_extraction_cache):
    def reported() -> dict[str, Any]:
        result = CliRunner().invoke(cli, ["doctor", "--format", "json"], catch_exceptions=False)
        return json.loads(result.stdout)["environment"]["extraction_cache"]

    assert reported() == {"path": str(_private_extraction_cache), "entries": 0, "bytes": 0}
    apply(tmp_path / "a")
    (entry,) = entries(_private_extraction_cache)
    assert reported()["entries"] == 1
    assert reported()["bytes"] == sum(f.stat().st_size for f in entry.iterdir())


def test_damaged_entry_is_removed_and_the_run_extracts(tmp_path, _private_extraction_cache):
    apply(tmp_path / "a")
    (entry,) = entries(_private_extraction_cache)
    victim = next(entry.glob("*_decode_ir.json"))
    victim.write_bytes(victim.read_bytes().replace(b"aten.", b"aten_", 1))  # same size, other bytes

    again = apply(tmp_path / "b")
    assert again["extraction"]["cache"]["hit"] is False and again["extraction"]["cache"]["stored"] is True
    assert any("does not match its recorded sha256" in note for note in again["extraction"]["notes"])
    assert files(tmp_path / "a") == files(tmp_path / "b")
    assert apply(tmp_path / "c")["extraction"]["cache"]["hit"] is True  # stored whole again


def test_unwritable_cache_never_fails_the_run(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache directory would go")
    monkeypatch.setenv("KADAPT_CACHE_DIR", str(blocker / "cache"))
    doc = apply(tmp_path / "out")
    assert doc["extraction"]["cache"]["stored"] is False
    assert "cannot write the cache" in doc["extraction"]["cache"]["reason"]
    written = [Path(g["path"]).name for g in doc["extraction"]["graphs"].values()]
    assert sorted(files(tmp_path / "out")) == sorted(
        [*written, "llama_kv_mapping.json", "llama_weight_map.json"]
    )


# -- the key ---------------------------------------------------------------------------------------


def key_of(spec=None, options=None, config=None, remote=None, revision=None) -> str:
    spec = spec or load_spec(LLAMA)
    options = options or options_from_spec(spec, output_dir=Path("out"))
    return run_key(
        spec, options, source_raw=config or CONFIG, remote_code=remote, revision=revision, device="meta"
    ).digest


def test_key_follows_every_input_and_nothing_else(tmp_path):
    spec = load_spec(LLAMA)
    base = key_of(spec)
    assert key_of(spec) == base  # stable
    options = options_from_spec(spec, output_dir=Path("out"))
    assert key_of(spec, dataclasses.replace(options, output_dir=tmp_path / "elsewhere")) == base
    assert key_of(spec, dataclasses.replace(options, max_cache_len=options.max_cache_len + 1)) != base
    assert key_of(spec, dataclasses.replace(options, dtype="float32")) != base
    assert key_of(spec.without([spec.entry_ids[0]])) != base  # --without
    assert key_of(spec, config={**CONFIG, "rope_theta": CONFIG["rope_theta"] * 2}) != base
    assert key_of(spec, config={**CONFIG, "_comment": "any key at all"}) != base

    code = tmp_path / "model"
    code.mkdir()
    (code / "modeling_x.py").write_text("X = 1\n")
    remote = key_of(spec, remote=code)
    assert remote != base
    (code / "modeling_x.py").write_text("X = 2\n")
    assert key_of(spec, remote=code) != remote
    assert key_of(spec, remote="org/model", revision="a" * 40) != key_of(
        spec, remote="org/model", revision="b" * 40
    )


def test_key_follows_kadapts_own_files(tmp_path, monkeypatch):
    package = tmp_path / "kimi_adapter_core"
    shutil.copytree(cache_key._PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(cache_key, "_PACKAGE", package)
    keys = [key_of()]
    # an edit anywhere in the package is a new key: inside the backend and far from it
    for edited in (package / "backends" / "extraction" / "ir" / "encoding.py", package / "spec" / "model.py"):
        edited.write_text(edited.read_text() + "\n# any edit\n")
        keys.append(key_of())
    assert len(set(keys)) == 3


def test_key_follows_user_impl_source(tmp_path, monkeypatch):
    module = tmp_path / "kadapt_cache_impl.py"
    module.write_text("def fn(original, *args, **kwargs):\n    return original(*args, **kwargs)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = load_spec(LLAMA)
    raw = json.loads(json.dumps(spec.raw))
    raw["patches"] = [{"id": "U1", "kind": "wrap", "impl": "kadapt_cache_impl:fn"}]
    with_impl = dataclasses.replace(spec, raw=raw)
    first = key_of(with_impl)
    module.write_text(module.read_text() + "# changed\n")
    assert key_of(with_impl) != first
    raw["patches"] = [{"id": "U1", "kind": "wrap", "impl": "kadapt_no_such_module_anywhere:fn"}]
    with pytest.raises(Uncacheable, match="kadapt_no_such_module_anywhere"):
        key_of(dataclasses.replace(spec, raw=raw))


def fake_distribution(site: Path, record: str, *, editable: bool) -> None:
    (site / "kadaptfake").mkdir(parents=True, exist_ok=True)
    (site / "kadaptfake" / "__init__.py").write_text("VALUE = 1\n")
    info = site / "kadaptfake-1.0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: kadaptfake\nVersion: 1.0\n")
    (info / "RECORD").write_text(record)
    if editable:
        (info / "direct_url.json").write_text(
            json.dumps({"url": "file:///src", "dir_info": {"editable": True}})
        )


def test_library_digest_follows_installed_files(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    fake_distribution(tmp_path, "kadaptfake/__init__.py,sha256=AAA,10\n", editable=False)
    first = library_digest("kadaptfake")
    fake_distribution(tmp_path, "kadaptfake/__init__.py,sha256=BBB,10\n", editable=False)  # rebuilt wheel
    assert library_digest("kadaptfake") != first

    fake_distribution(tmp_path, "", editable=True)  # editable: the file list says nothing, the files do
    sys.modules.pop("kadaptfake", None)
    editable = library_digest("kadaptfake")
    (tmp_path / "kadaptfake" / "__init__.py").write_text("VALUE = 22\n")
    assert library_digest("kadaptfake") != editable
    assert library_digest("torch") == library_digest("torch")


def test_key_follows_the_environment(tmp_path, monkeypatch):
    before = key_of()
    monkeypatch.setenv("KADAPT_UNRELATED", "1")
    assert key_of() == before
    monkeypatch.setenv("TORCH_SOMETHING", "1")  # torch and transformers read their own variables
    changed = key_of()
    assert changed != before
    monkeypatch.syspath_prepend(str(tmp_path))  # an optional package appears (e.g. a kernels hub)
    (tmp_path / "kernels-0.1.dist-info").mkdir()
    assert key_of() != changed


def test_canonical_refuses_what_it_cannot_hash():
    assert canonical({"a": (1, Path("x/y"))}) == [["a", [1, {"__path__": "x/y"}]]]
    with pytest.raises(Uncacheable, match="object"):
        canonical(object())


def test_prune_keeps_the_most_recently_used(tmp_path):
    cache = ExtractionCache(tmp_path, max_entries=2)
    for age, name in enumerate(["old", "mid", "new"]):
        (tmp_path / name).mkdir()
        (tmp_path / name / "entry.json").write_text("{}")
        stamp = 1_000_000 + age
        os.utime(tmp_path / name / "entry.json", (stamp, stamp))
    (tmp_path / ".dead.tmp").mkdir()
    os.utime(tmp_path / ".dead.tmp", (0, 0))
    (tmp_path / ".live.tmp").mkdir()  # another process is storing right now
    (tmp_path / "stray").mkdir()  # no entry file: not an entry, removed first
    cache.prune()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".live.tmp", "mid", "new"]
