"""``kadapt generate``: goldens, determinism, formatting, --check, errors, the TensorCast profile and docs.

Everything here renders templates and imports the torch-free TensorCast module; the extraction
module is exercised against kadapt's own backend in ``test_generate_extraction.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import importlib.util
import json
import re
import shutil
import subprocess
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import yaml
from click.testing import CliRunner
from fixtures.modules import import_path, outside_runtime

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.ir import encoding
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.extraction.runtime import step, step_bind, symbolic
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.generate import check_all, render_spec, write_all
from kimi_adapter_core.generate import environment as jinja_environment
from kimi_adapter_core.generate.embed import split_module
from kimi_adapter_core.generate.pyformat import _ruff_command, format_python
from kimi_adapter_core.generate.simulation import PROFILE_FIELDS
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
SPECS = REPO / "specs"
KIMI = SPECS / "kimi_k25.yaml"
ALL_TARGETS = ("extraction", "simulation", "docs")


def shipped_specs() -> list[Path]:
    return sorted(SPECS.glob("*.yaml"))


SHIPPED = shipped_specs()
MLA_WORDS = ("mla", "latent", "reexpand", "absorbed", "kv_lora")


@functools.cache
def rendered(spec_path: Path) -> tuple[dict[str, str], tuple[str, ...]]:
    """Every target of a shipped spec, rendered once per test session: ``{path: text}`` and notes."""
    files, notes = render_spec(load_spec(spec_path), ALL_TARGETS, skip_inexpressible=True)
    return {str(f.path): f.text for f in files}, tuple(notes)


@pytest.fixture(scope="module")
def kimi_files() -> dict[str, str]:
    files, notes = rendered(KIMI)
    assert notes == ()
    return files


# -- goldens, determinism, formatting ---------------------------------------------------------------


@pytest.mark.parametrize("spec_path", SHIPPED, ids=lambda p: p.stem)
def test_committed_outputs_match_a_fresh_render(spec_path: Path) -> None:
    files, _ = rendered(spec_path)
    assert files, f"{spec_path.name} renders nothing"
    for path, text in files.items():
        committed = REPO / path
        assert committed.is_file(), f"{path} is not committed: run `kadapt generate`"
        assert committed.read_bytes() == text.encode("utf-8"), f"{path} is stale"


@pytest.mark.parametrize("spec_path", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_spec_renders_every_target_it_can(spec_path: Path) -> None:
    """Extraction module, TensorCast profile and docs page for each spec; only a spec without an
    ``abi`` skips the extraction target, and only one whose
    experts TensorCast cannot read (``experts_layout: other``) or whose layers it cannot declare the
    TensorCast profile, and each says so."""
    spec = load_spec(spec_path)
    files, notes = rendered(spec_path)
    name = spec.name
    expected = {"adapters/__init__.py", f"adapters/{name}/__init__.py", f"docs/specs/{name}.md"}
    skipped = []
    if spec.abi is not None:
        expected.add(f"adapters/{name}/extraction.py")
    else:
        skipped.append(f"{name}: target 'extraction' skipped: the spec has no 'abi' entry")
    lacks = beyond_tensorcast(spec)
    if lacks is not None:  # linear attention, DSA, chunked attention: each note names what TensorCast lacks
        assert len(notes) == len(skipped) + 1 and notes[-1].startswith(
            f"{name}: target 'simulation' skipped:"
        )
        assert "TensorCast" in notes[-1] and lacks in notes[-1]
        notes = notes[:-1]
    elif spec.backend_options("simulation").get("experts_layout") != "other":
        expected.add(f"adapters/{name}/tensorcast_profile.py")
    else:
        skipped.append(
            f"{name}: target 'simulation' skipped: backends.simulation.experts_layout is 'other': "
            "TensorCast's per-expert adapter (MoeExpertMLP: hidden_dim, intermediate_dim, act_fn, "
            "gate_up_proj, down_proj) cannot read these experts"
        )
    assert notes == tuple(skipped)
    assert set(files) == expected


def beyond_tensorcast(spec: Any) -> str | None:
    """What the refusal of a generated TensorCast profile says for a stack whose layers it cannot
    declare: linear attention or DSA indexer keys (priced only by TensorCast's builtin profiles),
    compressed attention (DeepSeek-V4: no compressor field) or chunked attention (Llama-4: ModelProfile
    has no chunk field); None for a stack it can."""
    from kimi_adapter_core.structure.of_spec import structure_of_raw

    structure = structure_of_raw(spec, json.loads(spec.source.config.read_text()))
    if structure.linear is not None or structure.indexer is not None:
        return "builtin profile"
    if structure.compressors:
        return "declares a compressor"
    return "declares an attention chunk" if structure.has_chunked_layers else None


def test_kimi_renders_every_target(kimi_files: dict[str, str]) -> None:
    assert sorted(kimi_files) == [
        "adapters/__init__.py",
        "adapters/kimi_k25/__init__.py",
        "adapters/kimi_k25/extraction.py",
        "adapters/kimi_k25/tensorcast_profile.py",
        "docs/specs/kimi_k25.md",
    ]


@pytest.mark.parametrize("spec_path", [p for p in SHIPPED if not load_spec(p).mla], ids=lambda p: p.stem)
def test_non_mla_outputs_never_speak_of_mla(spec_path: Path) -> None:
    """A GQA model's docs, profile and extraction module (outside the verbatim runtime, which serves
    every family) say nothing about latent caches or MLA attention."""
    for path, text in rendered(spec_path)[0].items():
        if path.endswith("extraction.py"):
            text = outside_runtime(text)
        found = [w for w in MLA_WORDS if w in text.lower()]
        assert not found, f"{path}: {found}"


def test_rendering_is_deterministic_and_location_free(tmp_path: Path) -> None:
    runner = CliRunner()
    for out in ("a", "b"):
        result = runner.invoke(cli, ["generate", str(KIMI), "--out", str(tmp_path / out)])
        assert result.exit_code == 0, result.output
    first, second = (
        {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}
        for root in (tmp_path / "a", tmp_path / "b")
    )
    assert first == second and len(first) == 5
    for data in first.values():
        text = data.decode()
        assert str(REPO) not in text and str(tmp_path) not in text
        assert text.endswith("\n") and not text.endswith("\n\n")


@pytest.mark.parametrize("spec_path", SHIPPED, ids=lambda p: p.stem)
def test_python_outputs_compile_and_are_ruff_clean(spec_path: Path, tmp_path: Path) -> None:
    files, _ = rendered(spec_path)
    for name, text in files.items():
        if not name.endswith(".py"):
            continue
        compile(text, name, "exec")
        assert format_python(text, name) == text, f"{name} is not stable under ruff"
        target = tmp_path / name
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text)
    # The repository's own ruff settings. The only tolerated findings are over-long lines inside the
    # verbatim runtime block (formatting is off there; runtime.py itself must fix them). Ruff
    # run the way format_python runs it (pyformat's lookup of the binary).
    lint = subprocess.run(
        [*_ruff_command(), "check", "--config", str(REPO / "pyproject.toml")]
        + ["--output-format", "json", str(tmp_path)],
        capture_output=True,
        text=True,
    )
    extraction = files.get(f"adapters/{spec_path.stem}/extraction.py", "# fmt: off\n# fmt: on").splitlines()
    runtime_block = range(extraction.index("# fmt: off"), extraction.index("# fmt: on") + 1)
    for finding in json.loads(lint.stdout):
        where = f"{finding['filename']}:{finding['location']['row']}"
        assert finding["code"] == "E501" and finding["filename"].endswith("extraction.py"), where
        assert finding["location"]["row"] - 1 in runtime_block, where


def test_extraction_module_embeds_runtime_and_builtin_source(kimi_files: dict[str, str]) -> None:
    text = kimi_files["adapters/kimi_k25/extraction.py"]
    assert split_module(Path(runtime.__file__)).body in text  # byte for byte
    assert "def mla_expand_kv_functional(" in text and "torch.cat((k_nope, k_rot), dim=-1)" in text
    assert split_module(Path(encoding.__file__)).body in text
    assert split_module(Path(upstream.__file__)).body in text
    # the reference binder too, its one relative import (KadaptError) defined by the module itself
    binder = split_module(Path(symbolic.__file__), provided=frozenset({"KadaptError"}))
    assert binder.body in text and "class KadaptError(ValueError):" in text
    with pytest.raises(KadaptError, match="symbolic.py uses a relative import"):
        split_module(Path(symbolic.__file__))
    # the step graph's wrapper over the runtime and its binding over the binder, their imports provided
    step_wrapper = split_module(Path(step.__file__), provided=split_module(Path(runtime.__file__)).names)
    step_binder = split_module(Path(step_bind.__file__), provided=binder.names | {"KadaptError"})
    assert step_wrapper.body in text and step_binder.body in text
    provenance = [split_module(Path(m.__file__)).source for m in (runtime, encoding, upstream)]
    provenance += [binder.source, step_wrapper.source, step_binder.source]
    assert provenance[2] == "kimi_adapter_core/upstream.py"
    for name in provenance:
        assert f"verbatim from {name}" in text
        text = text.replace(name, "")
    assert "kimi_adapter_core" not in text
    # one plain statement per extraction bridge, under its id and why
    spec = load_spec(KIMI)
    for bridge in spec.config_bridges:
        assert (f"# {bridge.id} ({bridge.op}):" in text) == ("extraction" in bridge.backends)
    assert 'written += _assign(raw, "text_config._experts_implementation", "batched_mm")' in text


# -- --check and writing ------------------------------------------------------------------------------


def test_check_reports_missing_and_stale_files_then_passes(tmp_path: Path) -> None:
    runner = CliRunner()
    args = ["generate", str(KIMI), "--out", str(tmp_path)]
    missing = runner.invoke(cli, [*args, "--check"])
    assert missing.exit_code == 1
    assert "missing: adapters/kimi_k25/extraction.py" in missing.output
    assert not (tmp_path / "adapters").exists(), "--check must not write"

    assert runner.invoke(cli, args).exit_code == 0
    assert runner.invoke(cli, [*args, "--check"]).exit_code == 0

    profile = tmp_path / "adapters/kimi_k25/tensorcast_profile.py"
    profile.write_text(profile.read_text().replace('"DeepseekV3MoE"', '"SomethingElse"'))
    stale = runner.invoke(cli, [*args, "--check"])
    assert stale.exit_code == 1
    assert "stale: adapters/kimi_k25/tensorcast_profile.py" in stale.output
    assert '-    "moe_module_name": "SomethingElse"' in stale.output
    assert '+    "moe_module_name": "DeepseekV3MoE"' in stale.output
    assert "1 generated file(s) out of date" in stale.output


def test_check_without_spec_covers_the_shipped_specs_in_place() -> None:
    result = CliRunner().invoke(cli, ["generate", "--check"])
    assert result.exit_code == 0, result.output
    assert "up to date" in result.output


def test_unchanged_files_are_not_rewritten(tmp_path: Path) -> None:
    files, _ = render_spec(load_spec(KIMI), ("docs",))
    assert len(write_all(files, tmp_path)) == 1
    assert write_all(files, tmp_path) == []
    assert check_all(files, tmp_path) == []


# -- errors: named entry and target, nothing half-written ----------------------------------------------


def spec_variant(tmp_path: Path, edit: Any, base: Path = KIMI) -> Path:
    """A copy of a shipped spec (Kimi's by default, with its config) under ``tmp_path``, edited by
    ``edit(raw)``."""
    shutil.copytree(SPECS / base.stem, tmp_path / base.stem)
    raw = yaml.safe_load(base.read_text())
    edit(raw)
    path = tmp_path / "variant.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.mark.parametrize(("entry", "target"), [("abi", "extraction"), ("module_paths", "simulation")])
def test_missing_entry_is_a_clear_error_and_writes_nothing(tmp_path: Path, entry: str, target: str) -> None:
    def drop(raw: dict[str, Any]) -> None:
        raw.pop(entry)

    path = spec_variant(tmp_path, drop)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["generate", str(path), "--target", target, "--out", str(out)])
    if result.exit_code != 1 and "invalid spec" in str(result.exception):
        pytest.skip(f"the validator already rejects a spec without {entry}")
    assert result.exit_code == 1, result.output
    assert f"cannot generate target '{target}'" in result.output and f"no '{entry}' entry" in result.output
    assert not out.exists()


def test_target_all_skips_what_a_spec_cannot_produce_with_a_note(tmp_path: Path) -> None:
    path = spec_variant(tmp_path, lambda raw: raw.pop("abi"))
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["generate", str(path), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "target 'extraction' skipped: the spec has no 'abi' entry" in result.output
    assert (out / "adapters/kimi_k25/tensorcast_profile.py").is_file()
    assert not (out / "adapters/kimi_k25/extraction.py").exists()


def test_template_error_names_template_and_target_and_writes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    broken = tmp_path / "templates"
    shutil.copytree(REPO / "templates", broken)
    docs = broken / "docs" / "spec.md.j2"
    docs.write_text(docs.read_text().replace("{{ spec.model }}", "{{ spec.no_such_field }}", 1))
    monkeypatch.setattr(jinja_environment, "shipped_dir", lambda name: broken)
    jinja_environment.environment.cache_clear()
    try:
        out = tmp_path / "out"
        result = CliRunner().invoke(cli, ["generate", str(KIMI), "--out", str(out)])
    finally:
        jinja_environment.environment.cache_clear()
    assert result.exit_code == 1
    assert "cannot generate target 'docs' for spec 'kimi_k25': template spec.md.j2:2" in result.output
    assert "no_such_field" in result.output
    assert not out.exists(), "extraction and simulation rendered fine but must not be written alone"


def test_default_out_is_refused_for_specs_outside_the_checkout(tmp_path: Path) -> None:
    path = spec_variant(tmp_path, lambda raw: None)
    result = CliRunner().invoke(cli, ["generate", str(path), "--target", "docs"])
    assert result.exit_code == 2
    assert "--out is required" in result.output


# -- the TensorCast profile ---------------------------------------------------------------------------


@pytest.fixture()
def profile_module(
    kimi_files: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Any]:
    path = tmp_path / "tensorcast_profile.py"
    path.write_text(kimi_files["adapters/kimi_k25/tensorcast_profile.py"])
    for name in [n for n in sys.modules if n == "tensor_cast" or n.startswith("tensor_cast.")]:
        monkeypatch.delitem(sys.modules, name)
    module = import_path(path, "generated_tensorcast_profile")
    yield module
    if hasattr(module, "remove_patches"):  # the profile installs its patches when TensorCast loads
        module.remove_patches()


@pytest.mark.parametrize(
    "spec_path",
    [
        p
        for p in SHIPPED
        if load_spec(p).backend_options("simulation").get("experts_layout") != "other"
        and beyond_tensorcast(load_spec(p)) is None
    ],
    ids=lambda p: p.stem,
)
def test_every_profile_claims_only_what_its_spec_declares(
    spec_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each committed profile imports without TensorCast; every field traces to a spec entry, a spec
    without ``mla`` gets no MLA module (no absorbed-MLA swap), one without ``moe`` no MoE fields."""
    spec = load_spec(spec_path)
    for name in [n for n in sys.modules if n == "tensor_cast" or n.startswith("tensor_cast.")]:
        monkeypatch.delitem(sys.modules, name)
    module = import_path(REPO / "adapters" / spec.name / "tensorcast_profile.py", f"profile_{spec.name}")
    assert not any(n == "tensor_cast" or n.startswith("tensor_cast.") for n in sys.modules)
    sources = dict(PROFILE_FIELDS)
    for name, value in module.PROFILE.items():
        source = sources[name]
        if name == "model_type" and "model_type" not in (spec.backends.get("simulation") or {}):
            source = "gate.model_type"
        node: Any = spec.raw
        for key in source.split("."):
            node = node[key]
        assert value == node, name
    fields = set(module.PROFILE)
    assert bool(fields & {"mla_module_name", "mla_field_names_override"}) == bool(spec.mla)
    assert bool({f for f in fields if f.startswith("moe_")}) == bool(spec.moe)
    if hasattr(module, "remove_patches"):
        module.remove_patches()


def test_dense_profile_bridges_nothing_and_leaves_other_models_alone() -> None:
    """The Llama profile: no simulation bridges, so its config patch returns the config unchanged; a
    Mistral config (another model_type) is not even looked at."""
    from transformers import LlamaConfig, MistralConfig

    module = import_path(REPO / "adapters" / "llama" / "tensorcast_profile.py", "profile_llama_dense")
    llama = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    mistral = MistralConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    for config in (llama, mistral):
        before = config.to_dict()
        assert module.hf_config_patch_method(config, None) is config
        assert config.to_dict() == before
    assert module.gate_matches(llama) and not module.gate_matches(mistral)
    assert not hasattr(module, "PATCHES")


def test_profile_imports_without_tensorcast_and_every_field_traces_to_the_spec(profile_module: Any) -> None:
    assert not any(n == "tensor_cast" or n.startswith("tensor_cast.") for n in sys.modules)
    spec = load_spec(KIMI)
    sources = dict(PROFILE_FIELDS)
    for name, value in profile_module.PROFILE.items():
        node: Any = spec.raw
        for key in sources[name].split("."):
            node = node[key]
        assert value == node, name
    profile = profile_module.PROFILE
    assert profile["moe_module_name"] == "DeepseekV3MoE"
    assert profile["mla_module_name"] == "DeepseekV3Attention"
    assert profile["moe_num_experts_key"] == ["text_config", "n_routed_experts"]
    # rooted at the class TensorCast builds (AutoModel: Kimi_K25Model), not kadapt's ForConditionalGeneration
    assert profile_module.MODULE_PATHS["language_layers_path_str"] == "language_model.layers"
    assert profile_module.MODULE_PATHS["visual_layers_path_str"] == "vision_tower.layers"
    assert profile["mla_field_names_override"] == {}  # the native class uses TensorCast's own field names
    assert profile["moe_route_after_dp_transform"] is True
    assert profile["moe_gate_returns_raw_logits"] is False


def hub_config() -> dict[str, Any]:
    return json.loads((SPECS / "kimi_k25" / "config.json").read_text())


def to_namespace(value: Any) -> Any:
    if isinstance(value, dict):
        return SimpleNamespace(**{k: to_namespace(v) for k, v in value.items()})
    return value


def test_config_patch_is_gated_per_call(profile_module: Any) -> None:
    other = {"model_type": "deepseek_v3", "n_routed_experts": 256, "vision_config": {"vt_hidden_size": 3}}
    untouched = copy.deepcopy(other)
    assert profile_module.hf_config_patch_method(other, "deepseek-ai/DeepSeek-V3") is other
    assert other == untouched
    wrong_sub_config = hub_config()
    wrong_sub_config["text_config"]["model_type"] = "llama"
    before = copy.deepcopy(wrong_sub_config)
    profile_module.hf_config_patch_method(wrong_sub_config, "x")
    assert wrong_sub_config == before


def test_config_patch_bridges_dicts_and_namespaces(profile_module: Any) -> None:
    as_dict = profile_module.hf_config_patch_method(hub_config(), "moonshotai/Kimi-K2.5")
    vision = as_dict["vision_config"]
    assert vision["hidden_size"] == 1152 and "vt_hidden_size" not in vision
    assert vision["pos_emb_time"] == 4 and "init_pos_emb_time" not in vision
    assert (vision["spatial_merge_size"], vision["temporal_patch_size"], vision["in_channels"]) == (2, 1, 3)
    assert (as_dict["n_routed_experts"], as_dict["n_shared_experts"]) == (384, 1)
    assert "_experts_implementation" not in as_dict["text_config"], "extraction-only bridge leaked"

    raw = hub_config()
    raw["text_config"]["_attn_implementation"] = "flash_attention_2"
    del raw["text_config"]["n_shared_experts"]
    ns = profile_module.hf_config_patch_method(to_namespace(raw), None)
    assert ns.vision_config.num_hidden_layers == 27 and not hasattr(ns.vision_config, "vt_num_hidden_layers")
    assert ns.n_routed_experts == 384 and ns.n_shared_experts == 1  # the fallback
    flash = importlib.util.find_spec("flash_attn") is not None
    assert ns.text_config._attn_implementation == ("flash_attention_2" if flash else "eager")


def test_register_without_tensorcast_raises_a_clear_import_error(
    profile_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tensor_cast", None)  # import tensor_cast -> ImportError
    with pytest.raises(ImportError, match="needs TensorCast .*custom_model_registry cannot be imported"):
        profile_module.register()
    with pytest.raises(ImportError, match="needs TensorCast"):
        with profile_module.replace_builtin():
            pass


def fake_tensorcast(monkeypatch: pytest.MonkeyPatch) -> types.ModuleType:
    """A stand-in for ``tensor_cast.transformers.custom_model_registry`` with its registration rules."""
    import contextlib

    @dataclasses.dataclass
    class ModelProfile:
        model_type: str
        moe_module_name: str | None = None
        moe_num_experts_key: str | list[str] = "num_experts"
        moe_route_after_dp_transform: bool = False
        moe_gate_returns_raw_logits: bool = False
        moe_field_names_override: dict | None = None
        mtp_block_module_name: str | None = None
        mla_module_name: str | None = None
        hf_config_patch_method: Any = None
        mla_field_names_override: dict | None = None
        visual_module_path: str | None = None
        language_module_path: str | None = None
        visual_layers_module_path: str | None = None
        visual_layers_path_str: str | None = None
        language_layers_path_str: str | None = None
        patch_method: Any = None
        custom_expert_module_type: Any = None
        mla_module_class_type: Any = None

    registry_dict: dict[str, ModelProfile] = {}

    def register_model_profile(profile: ModelProfile) -> ModelProfile:
        if profile.model_type in registry_dict:
            raise ValueError(f"ModelProfile for '{profile.model_type}' is already registered.")
        registry_dict[profile.model_type] = profile
        return profile

    @contextlib.contextmanager
    def ignore_model_profiles(model_types: list[str]) -> Any:
        removed = {t: registry_dict.pop(t) for t in model_types if t in registry_dict}
        try:
            yield
        finally:
            registry_dict.update(removed)

    registry = types.ModuleType("tensor_cast.transformers.custom_model_registry")
    registry.ModelProfile = ModelProfile  # type: ignore[attr-defined]
    registry.register_model_profile = register_model_profile  # type: ignore[attr-defined]
    registry.ignore_model_profiles = ignore_model_profiles  # type: ignore[attr-defined]
    registry.REGISTRY = registry_dict  # type: ignore[attr-defined]
    package = types.ModuleType("tensor_cast")
    transformers_pkg = types.ModuleType("tensor_cast.transformers")
    package.transformers = transformers_pkg  # type: ignore[attr-defined]
    transformers_pkg.custom_model_registry = registry  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tensor_cast", package)
    monkeypatch.setitem(sys.modules, "tensor_cast.transformers", transformers_pkg)
    monkeypatch.setitem(sys.modules, "tensor_cast.transformers.custom_model_registry", registry)
    return registry


def test_register_and_duplicate(profile_module: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    registry = fake_tensorcast(monkeypatch)
    profile = profile_module.register()
    assert registry.REGISTRY["kimi_k25"] is profile
    assert profile.language_module_path == "language_model"
    assert profile.hf_config_patch_method is profile_module.hf_config_patch_method
    with pytest.raises(ValueError, match="already has a ModelProfile for 'kimi_k25'.*replace_builtin"):
        profile_module.register()


def test_replace_builtin_swaps_for_the_block_and_restores(
    profile_module: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    registry = fake_tensorcast(monkeypatch)
    builtin = registry.ModelProfile("kimi_k25", visual_layers_path_str="vision_tower.encoder.blocks")
    registry.register_model_profile(builtin)
    with profile_module.replace_builtin() as ours:
        assert registry.REGISTRY["kimi_k25"] is ours
        assert ours.visual_layers_path_str == "vision_tower.layers"
    assert registry.REGISTRY["kimi_k25"] is builtin


# -- docs ---------------------------------------------------------------------------------------------


def test_docs_tables_flowchart_and_abi(kimi_files: dict[str, str]) -> None:
    doc = kimi_files["docs/specs/kimi_k25.md"]
    spec = load_spec(KIMI)
    for bridge in spec.config_bridges:
        assert f"| {bridge.id} | {bridge.op} |" in doc
    for patch in spec.patches:
        assert f"| {patch.id} | `{patch.target}` | {patch.kind} |" in doc
    assert "```mermaid\nflowchart TD" in doc and "SRC --> BR --> P0 --> M" in doc and "DI --> KV" in doc
    assert "| input | `past.{layer}.key` | `[1, 1, 2048, 512]` | bfloat16 |" in doc
    assert "| input | `past.{layer}.value` | `[1, 1, 2048, 64]` | bfloat16 |" in doc
    assert "| output | `present.{layer}.key` | `[1, 1, 128, 512]` | bfloat16 |" in doc  # prefill
    assert "| output | `logits` | `[1, 1, 163840]` | bfloat16 |" in doc
    assert "| `transformers` | `>=5.23,<6` |" in doc
    assert "| Q1 | `language_model.model.layers.*.mlp.experts.*` | 4 | 32 | int32 | bfloat16 |" in doc
    assert "70,272 B per token" in doc


def test_expanded_layout_docs_use_per_head_shapes(tmp_path: Path) -> None:
    path = spec_variant(tmp_path, lambda raw: raw["abi"].update(kv_layout="expanded"))
    files, _ = render_spec(load_spec(path), ("docs",))
    doc = files[0].text
    assert "| input | `past.{layer}.key` | `[1, 64, 2048, 192]` | bfloat16 |" in doc
    assert "| input | `past.{layer}.value` | `[1, 64, 2048, 128]` | bfloat16 |" in doc


def test_error_type_is_kadapt_error(tmp_path: Path) -> None:
    path = spec_variant(tmp_path, lambda raw: raw.pop("abi"))
    with pytest.raises(KadaptError, match="'extraction'.*no 'abi' entry"):
        render_spec(load_spec(path), ("extraction",))


def test_docs_show_the_structure_and_the_kv_layouts_of_mla(kimi_files: dict[str, str]) -> None:
    doc = kimi_files["docs/specs/kimi_k25.md"]
    assert "## Structure" in doc and "61 layers, hidden 7168, MLA 64 heads, kv_lora_rank 512" in doc
    assert "| attention.kind | `mla` |" in doc and "| moe.num_experts | `384` |" in doc
    assert "| 0 | full | — | dense |" in doc and "| 1 .. 60 | full | — | moe |" in doc
    assert "| `latent` | 1 x 512 | 1 x 64 | 576 | default for MLA, the ABI's |" in doc
    assert "| `expanded` | 64 x 192 | 64 x 128 | 20,480 | — |" in doc
    assert "latent KV, reexpand MLA" in doc and "static latent KV cache of 2048" in doc


def test_docs_of_a_sliding_window_gqa_family() -> None:
    doc = rendered(SPECS / "mistral.yaml")[0]["docs/specs/mistral.md"]
    assert "32 layers, hidden 4096, GQA 32 heads / 8 KV heads x 128" in doc
    assert "| 0 .. 31 | sliding | 4096 | dense |" in doc
    assert "| `heads` | 8 x 128 | 8 x 128 | 2,048 | default for GQA, the ABI's |" in doc
    assert "heads KV, GQA" in doc and "Sliding-window layers (window 4096)" in doc
    assert "| input | `past.{layer}.key` | `[1, 8, 2048, 128]` | bfloat16 |" in doc
    assert "| output | `present.{layer}.value` | `[1, 8, 128, 128]` | bfloat16 |" in doc  # prefill
    assert "131,072 B per token (32 layers x 8 x (128 + 128) x 2 B)" in doc
    assert "sliding-window masks in-graph" in doc


def test_docs_of_moe_families_show_their_layer_kinds() -> None:
    qwen = rendered(SPECS / "qwen3_moe.yaml")[0]["docs/specs/qwen3_moe.md"]
    assert "| 0 .. 93 | full | — | moe |" in qwen and "MoE 128 experts top-8" in qwen
    assert "| input | `past.{layer}.key` | `[1, 4, 2048, 128]` | bfloat16 |" in qwen
    deepseek = rendered(SPECS / "deepseek_v3.yaml")[0]["docs/specs/deepseek_v3.md"]
    assert "| 0 .. 2 | full | — | dense |" in deepseek and "| 3 .. 60 | full | — | moe |" in deepseek
    assert "| input | `past.{layer}.key` | `[1, 1, 2048, 512]` | bfloat16 |" in deepseek


def test_a_kv_layout_the_attention_cannot_have_is_a_located_error(tmp_path: Path) -> None:
    path = spec_variant(
        tmp_path, lambda raw: raw["abi"].update(kv_layout="latent"), base=SPECS / "llama.yaml"
    )
    for target in ("extraction", "docs"):  # plain validation (load_spec) already refuses it, located
        with pytest.raises(
            KadaptError, match="kv_layout 'latent' does not fit this model's GQA attention"
        ) as err:
            render_spec(load_spec(path), (target,))
        located = err.value.location or str(err.value)
        assert re.search(re.escape(str(path)) + r":\d+:\d+", located), located


def test_spec_text_cannot_escape_a_generated_docstring(tmp_path: Path) -> None:
    """metadata.model is free text: it reaches generated Python only as inert docstring text."""
    import importlib.util
    import shutil

    from click.testing import CliRunner

    from kimi_adapter_core.cli import cli

    shutil.copytree(REPO / "specs" / "llama", tmp_path / "llama")
    payload = 'x""" + str(__import__("pathlib").Path("PWNED").touch()) + """\n'
    text = (REPO / "specs" / "llama.yaml").read_text()
    text = text.replace("  model: meta-llama/Llama-3.1-8B", f"  model: {json.dumps(payload)}")
    (tmp_path / "llama.yaml").write_text(text)
    result = CliRunner().invoke(
        cli, ["generate", str(tmp_path / "llama.yaml"), "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 0, result.output
    for module_path in (tmp_path / "out" / "adapters" / "llama").glob("*.py"):
        spec = importlib.util.spec_from_file_location(f"hostile_{module_path.stem}", module_path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        assert 'x""" + str(__import__' in module.__doc__
    assert not (Path.cwd() / "PWNED").exists() and not (tmp_path / "PWNED").exists()


def test_verbatim_modules_that_define_the_same_name_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """runtime.py, encoding.py and upstream.py share one generated namespace: a name two of them define
    would silently replace the other's (as upstream's check_mla_attention once shadowed runtime's)."""
    from kimi_adapter_core.generate import extraction as generate_extraction

    real = generate_extraction.split_module

    def split(path: Path, **options: Any) -> Any:
        module = real(path, **options)
        if path.name == "upstream.py":
            module = dataclasses.replace(module, definitions=module.definitions | {"check_mla_attention"})
        return module

    monkeypatch.setattr(generate_extraction, "split_module", split)
    with pytest.raises(KadaptError, match=r"must not define the same names: \['check_mla_attention'\]"):
        render_spec(load_spec(KIMI), ("extraction",))
