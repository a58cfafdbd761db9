"""options_from_spec: spec defaults, CLI overrides, and every bad input caught before any work."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.model import GraphAbi

REPO = Path(__file__).resolve().parents[1]
SPEC = load_spec(REPO / "specs" / "kimi_k25.yaml")


def test_defaults_come_from_the_spec(tmp_path: Path) -> None:
    options = options_from_spec(SPEC, output_dir=tmp_path)
    assert (options.batch, options.prefill_len, options.max_cache_len) == (1, 128, 2048)
    assert (options.dtype, options.kv_layout, options.file_prefix) == ("bfloat16", "latent", "kimi_k25_text")
    assert options.path("prefill") == tmp_path / "kimi_k25_text_prefill_ir.json"
    assert options.path("kv_mapping") == tmp_path / "kimi_k25_text_kv_mapping.json"
    assert options.weight_renames[0] == (r"^model\.language_model\.", "language_model.model.")
    assert (options.verify_prefill_len, options.verify_max_cache_len, options.verify_decode_steps) == (
        8,
        40,
        24,
    )
    assert options.decode_names.inputs(2) == [
        "input_ids",
        "attention_mask",
        "position_ids",
        "cache_position",
        "past.0.key",
        "past.0.value",
        "past.1.key",
        "past.1.value",
    ]
    assert options.prefill_names.outputs(1) == ["logits", "present.0.key", "present.0.value"]


def test_cli_overrides_win(tmp_path: Path) -> None:
    options = options_from_spec(
        SPEC,
        output_dir=tmp_path / "new" / "dir",
        batch=2,
        prefill_len=16,
        max_cache_len=16,
        kv_layout="expanded",
    )
    assert (options.batch, options.prefill_len, options.max_cache_len, options.kv_layout) == (
        2,
        16,
        16,
        "expanded",
    )
    assert options.output_dir.is_dir()  # created (and probed) up front


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"batch": 0}, "batch must be a positive integer"),
        ({"prefill_len": -3}, "prefill_len must be a positive integer"),
        ({"max_cache_len": 0}, "max_cache_len must be a positive integer"),
        ({"prefill_len": 64, "max_cache_len": 32}, "prefill_len 64 does not fit in max_cache_len 32"),
        ({"kv_layout": "paged"}, "unknown kv_layout 'paged'"),
        ({"mla_attention": "fused"}, "unknown mla_attention 'fused'"),
        (
            {"kv_layout": "expanded", "mla_attention": "absorbed"},
            "abi.mla_attention 'absorbed' .* needs abi.kv_layout 'latent'",
        ),
    ],
)
def test_bad_sizes_and_layouts(tmp_path: Path, kwargs: dict, message: str) -> None:
    with pytest.raises(KadaptError, match=message):
        options_from_spec(SPEC, output_dir=tmp_path, **kwargs)


def test_mla_attention_from_spec_and_override(tmp_path: Path) -> None:
    assert SPEC.abi is not None and SPEC.abi.mla_attention == "reexpand"
    assert options_from_spec(SPEC, output_dir=tmp_path).mla_attention == "reexpand"
    assert options_from_spec(SPEC, output_dir=tmp_path, mla_attention="absorbed").mla_attention == "absorbed"
    absorbed = dataclasses.replace(SPEC, abi=dataclasses.replace(SPEC.abi, mla_attention="absorbed"))
    assert options_from_spec(absorbed, output_dir=tmp_path).mla_attention == "absorbed"
    assert options_from_spec(absorbed, output_dir=tmp_path, mla_attention="reexpand").mla_attention == (
        "reexpand"
    )
    with pytest.raises(KadaptError, match="needs abi.kv_layout 'latent'") as error:
        options_from_spec(absorbed, output_dir=tmp_path, kv_layout="expanded")
    assert error.value.location is not None and "kimi_k25.yaml" in error.value.location


def test_mla_attention_in_the_schema(tmp_path: Path) -> None:
    text = (REPO / "specs" / "kimi_k25.yaml").read_text()
    spec_file = tmp_path / "kimi_k25.yaml"
    layout = "  kv_layout: latent\n"
    spec_file.write_text(text.replace(layout, layout + "  mla_attention: absorbed\n"))
    (tmp_path / "kimi_k25").symlink_to(REPO / "specs" / "kimi_k25")
    spec = load_spec(spec_file)
    assert spec.abi is not None and spec.abi.mla_attention == "absorbed"
    spec_file.write_text(text.replace(layout, layout + "  mla_attention: fused\n"))
    with pytest.raises(Exception, match="mla_attention"):
        load_spec(spec_file)


def test_unwritable_output_dir(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(KadaptError, match="is not a directory"):
        options_from_spec(SPEC, output_dir=blocker / "out")


def test_spec_without_abi(tmp_path: Path) -> None:
    spec = dataclasses.replace(SPEC, abi=None)
    with pytest.raises(KadaptError, match="has no `abi` section"):
        options_from_spec(spec, output_dir=tmp_path)


def test_abi_names_must_keep_their_roles(tmp_path: Path) -> None:
    assert SPEC.abi is not None
    decode = GraphAbi(
        ("input_ids", "attention_mask", "position_ids", "past.{layer}.key"), SPEC.abi.decode.outputs
    )
    spec = dataclasses.replace(SPEC, abi=dataclasses.replace(SPEC.abi, decode=decode))
    with pytest.raises(KadaptError, match=r"abi.decode.inputs must be \[input_ids, attention_mask"):
        options_from_spec(spec, output_dir=tmp_path)


def test_entry_points_survive_importing_every_submodule() -> None:
    import importlib
    import pkgutil

    from kimi_adapter_core.backends import extraction

    for module in pkgutil.iter_modules(extraction.__path__):
        importlib.import_module(f"{extraction.__name__}.{module.name}")
    assert callable(extraction.run) and callable(extraction.verify) and callable(extraction.options_from_spec)


def test_importing_the_backend_does_not_import_torch() -> None:
    code = (
        "import sys; from kimi_adapter_core.backends.extraction import options_from_spec, run, verify; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_abi_dtype_must_be_a_float_dtype(tmp_path: Path) -> None:
    assert SPEC.abi is not None
    spec = dataclasses.replace(SPEC, abi=dataclasses.replace(SPEC.abi, dtype="int4"))
    with pytest.raises(KadaptError, match="abi.dtype 'int4' is not a floating dtype"):
        options_from_spec(spec, output_dir=tmp_path)


@pytest.mark.parametrize("escape", ["../../outside", "/tmp/kadapt-abs", "out/../../x"])
def test_spec_output_dir_stays_inside_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, escape: str
) -> None:
    """A spec cannot choose to write outside the working tree; the user's --output-dir can."""
    import dataclasses

    work = tmp_path / "work" / "tree"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    backends = {**SPEC.backends, "extraction": {**SPEC.backends["extraction"], "output_dir": escape}}
    hostile = dataclasses.replace(SPEC, backends=backends)
    with pytest.raises(KadaptError, match="leaves the working directory") as caught:
        options_from_spec(hostile)
    assert caught.value.location is not None and str(SPEC.path) in caught.value.location
    assert not (tmp_path / "outside").exists() and not Path("/tmp/kadapt-abs").exists()
    assert options_from_spec(hostile, output_dir=tmp_path / "mine").output_dir == tmp_path / "mine"
    inside = dataclasses.replace(
        SPEC, backends={**SPEC.backends, "extraction": {**SPEC.backends["extraction"], "output_dir": "a/b"}}
    )
    assert options_from_spec(inside).output_dir == work / "a" / "b"
