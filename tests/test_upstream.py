"""transformers' internals as kadapt meets them (``kimi_adapter_core/upstream.py``), and the day they move.

Against the installed transformers: every contact point holds, the dtype step equals what
``save_pretrained`` + ``from_pretrained`` really give, the layer probe finds the keyword the layers
declare. Against a faked future release (``fixtures/future_transformers.py``: the installed
transformers changed in place): ``kadapt apply``, ``kadapt doctor`` and a vendored generated module
each stop before any export with one error naming the contact point, what was expected, what was
found and the tested versions.
"""

from __future__ import annotations

import inspect
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import transformers
from click.testing import CliRunner
from fixtures import future_transformers
from fixtures.loader import loaded_dtypes, tiny_model
from fixtures.modules import REPO, import_path, without_kadapt_env

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.checkpoint.dtypes import cast_to_abi_dtype
from kimi_adapter_core.cli import cli
from kimi_adapter_core.spec import load_spec

pytestmark = pytest.mark.compat  # run by .ci/compat against other transformers releases
TESTED = ", ".join(upstream.TESTED_TRANSFORMERS)


@pytest.fixture
def future(request: pytest.FixtureRequest) -> Iterator[str]:
    """The installed transformers as a future release with ``request.param``'s change, for one test."""
    upstream.forget()
    restore = future_transformers.install(request.param)
    try:
        yield request.param
    finally:
        restore()
        upstream.forget()


# -- the installed transformers ---------------------------------------------------------------------


def test_every_contact_point_holds_on_the_installed_transformers() -> None:
    found = upstream.check()
    assert [f.name for f in found] == [p.name for p in upstream.CONTACT_POINTS]
    assert all(f.ok for f in found)


@pytest.mark.parametrize("family", ["deepseek_v3", "llama"])
def test_the_dtype_step_gives_what_from_pretrained_loads(family: str) -> None:
    """kadapt's bf16 model holds each tensor in the dtype transformers' own loader gives it (5.24 keeps
    DeepSeek-V3's router weight float32, 5.23 did not: both are what the loader does)."""
    model = tiny_model(family)
    cast_to_abi_dtype(model, [model], torch.bfloat16)
    ours = {name: t.dtype for name, t in model.state_dict().items()}
    assert ours == loaded_dtypes(family)
    assert (
        torch.float32 in ours.values() if family == "deepseek_v3" else set(ours.values()) == {torch.bfloat16}
    )


def test_the_layer_probe_finds_the_keyword_the_layers_declare() -> None:
    model = tiny_model("llama")
    declared = inspect.signature(type(model.model.layers[0]).forward).parameters
    keyword = upstream.decoder_protocol(model.model).cache_keyword
    assert keyword in declared and keyword == ("cache" if "cache" in declared else "past_key_values")


def test_an_attention_reading_more_of_the_cache_than_update_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The ABI's cache answers ``update`` (and ``get_seq_length``: Llama-4's temperature tuning); an
    attention that asks it for anything else (its capacity) is refused by the probe, before any export,
    naming what it asked for."""
    model = tiny_model("llama")
    attention = type(model.model.layers[0].self_attn)
    original = attention.forward

    def forward(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - a stand-in attention
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        cache.get_max_cache_shape(self.layer_idx)
        return original(self, *args, **kwargs)

    upstream.forget()
    monkeypatch.setattr(attention, "forward", forward)
    try:
        with pytest.raises(upstream.ContactPointMoved, match="reads cache.get_max_cache_shape") as caught:
            upstream.decoder_protocol(model.model)
    finally:
        upstream.forget()
    assert "cache_update" in str(caught.value) and TESTED in str(caught.value)


def test_a_probe_answers_only_for_the_forwards_it_ran(monkeypatch: pytest.MonkeyPatch) -> None:
    """A layer probed under one spec's patches must be probed again without them: Llama-4's rotary
    embedding gives (cos, sin) only under Scout's builtins, and a cached pass let the multimodal llama4
    type past its refusal when the family matrix had just adapted llama4_text in the same process."""
    model = tiny_model("llama")
    assert upstream.decoder_protocol(model.model).cache_keyword
    rotary = type(model.model.rotary_emb)
    real = rotary.forward
    monkeypatch.setattr(rotary, "forward", lambda self, x, position_ids: real(self, x, position_ids)[0])
    with pytest.raises(upstream.LayersUnsupported, match="returns Tensor"):
        upstream.decoder_protocol(model.model)


def test_a_layer_that_reads_tensor_values_is_refused_at_the_line_that_reads_them() -> None:
    """JetMoE's router reads its per-expert token counts as Python ints, which a meta model (and a static
    graph) has none of: the refusal names that line of transformers' modelling code."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from kimi_adapter_core.families.tiny import tiny_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config("jetmoe")))
    upstream.forget()
    with pytest.raises(upstream.LayersUnsupported) as refused:
        upstream.decoder_protocol(model.model)
    assert refused.value.code == "not-exportable"
    assert re.search(r"at models\.jetmoe\.modeling_jetmoe:\d+ in forward: .*\.tolist\(\)", str(refused.value))


def test_a_probe_is_keyed_by_every_method_the_layer_classes_hold(monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec patches helpers as well as forwards (DeepSeek-V3's ``expand_kv``): any method installed on
    a layer module's class (or a base of it) makes the layer a new one to probe; with the method gone
    again the first result answers."""
    model = tiny_model("llama")
    calls: list[int] = []
    probe = upstream._probe_layer

    def counted(*args: object) -> upstream.LayerProtocol:
        calls.append(1)
        return probe(*args)

    monkeypatch.setattr(upstream, "_probe_layer", counted)
    upstream.forget()
    try:
        upstream.decoder_protocol(model.model)
        upstream.decoder_protocol(model.model)
        assert len(calls) == 1  # both layers have one structure: probed once, then answered
        base = type(model.model.layers[0]).__mro__[1]  # GradientCheckpointingLayer: the bases count too
        assert base is not torch.nn.Module
        with monkeypatch.context() as patched:
            patched.setattr(base, "kadapt_helper", lambda self: None, raising=False)
            upstream.decoder_protocol(model.model)
            assert len(calls) == 2
        upstream.decoder_protocol(model.model)
        assert len(calls) == 2
    finally:
        upstream.forget()


def test_the_temporal_merge_layout_is_what_the_helper_returns() -> None:
    from transformers.models.kimi_k25.modeling_kimi_k25 import get_vision_temporal_merge_index

    returned = get_vision_temporal_merge_index(torch.tensor([[1, 4, 4]]), 2, 2)
    assert upstream.temporal_merge_layout() == ("scatter" if isinstance(returned, tuple) else "tensor")


# -- a future release, met by kadapt apply -----------------------------------------------------------

MOVED = "moved a contact point"
EXPECTED = {
    "update_signature": (
        MOVED,
        "cache_update",
        "expected Cache.update(key_states, value_states, layer_idx, *args, **kwargs); "
        "found Cache.update(self, layer_idx, key_states, value_states, **kwargs)",
    ),
    "attention_call": (
        "refused (cache-protocol): LlamaDecoderLayer does not fit kadapt's prefill/decode ABI",
        "cache_update",
        "expected update(key_states, value_states, layer_idx=0, ...); found LlamaDecoderLayer's attention "
        "calls update(0, Tensor[",
    ),
    "removed_helper": (
        MOVED,
        "loader_dtype_plan",
        "found transformers.core_model_loading has no build_glob_alternation",
    ),
}


def assert_clear_error(output: str, change: str) -> None:
    """One error: the contact point, expected and found, the tested versions; no traceback, no export."""
    headline, point, detail = EXPECTED[change]
    assert "Traceback" not in output and "torch.export" not in output
    output = output[output.index("error: ") :]
    if headline == MOVED:
        assert output.startswith(f"error: transformers {transformers.__version__} {MOVED}")
    else:
        assert output.startswith(f"error: {headline}")
    assert f"  {point} (" in output and detail in output
    assert f"kadapt is tested with transformers {TESTED}" in output


@pytest.mark.parametrize("future", future_transformers.CHANGES, indirect=True)
def test_apply_refuses_a_future_release_before_exporting(future: str, tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["apply", "llama", "--output-dir", str(tmp_path / "out")])
    assert result.exit_code == 1, result.output
    assert_clear_error(result.output, future)
    assert not any((tmp_path / "out").iterdir())  # checked writable up front, then nothing written


def test_apply_in_a_users_process_on_a_future_release(tmp_path: Path) -> None:
    """The same refusal as a user sees it: a fresh interpreter, the change made before kadapt runs."""
    proc = subprocess.run(
        [sys.executable, future_transformers.__file__, "update_signature", "--"]
        + ["-m", "kimi_adapter_core", "apply", "llama", "--output-dir", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stderr
    assert_clear_error(proc.stderr, "update_signature")
    assert not any((tmp_path / "out").iterdir())  # checked writable up front, then nothing written


@pytest.mark.parametrize("future", ["removed_helper"], indirect=True)
def test_doctor_names_what_moved(future: str) -> None:
    result = CliRunner().invoke(cli, ["doctor", "--format", "json"])
    assert result.exit_code == 1
    document = json.loads(result.stdout)
    status = {p["name"]: p["status"] for p in document["contact_points"]}
    assert status.pop("loader_dtype_plan") == "moved" and set(status.values()) == {"ok"}
    assert not document["ok"]


def test_doctor_passes_here_and_finds_a_moved_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    runner = CliRunner()
    ok = runner.invoke(cli, ["doctor"])
    assert ok.exit_code == 0, ok.output
    assert "MOVED" not in ok.output and "ok     kimi_k25 K1 " in ok.output
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    def expand_kv(self, kv_nope, k_rot):  # noqa: ANN001, ANN202 - an upstream edit
        return kv_nope, k_rot

    monkeypatch.setattr(deepseek.DeepseekV3Attention, "expand_kv", expand_kv)
    moved = runner.invoke(cli, ["doctor", "--format", "json"])
    assert moved.exit_code == 1
    pins = {(p["spec"], p["id"]): p for p in json.loads(moved.stdout)["pins"]}
    assert pins["kimi_k25", "K1"]["status"] == "moved" and "source_sha256" in pins["kimi_k25", "K1"]["found"]
    assert pins["kimi_k25", "P5"]["status"] == "ok"


# -- a future release, met by a vendored generated module ---------------------------------------------

USER_SCRIPT = """
import importlib.util, json, sys

path, overrides = sys.argv[1], json.loads(sys.argv[2])
spec = importlib.util.spec_from_file_location("vendored_extraction", path)
module = importlib.util.module_from_spec(spec)
spec.loader.exec_module(module)
print("imported", flush=True)
model = module.build_model(device="meta", overrides=overrides)
module.prefill_wrapper(model)
print("built the prefill wrapper", flush=True)
"""


def run_vendored(change: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    """adapters/llama/extraction.py copied outside the checkout, imported by a user's script in an
    interpreter that cannot import kadapt, on a faked future transformers. (The same on the installed
    transformers is ``test_generated_module_roundtrip.py``'s llama run: the same module vendored and
    run under ``-S``, built on meta from the same tiny overrides in both dtypes, its wrappers exported
    and executed.)"""
    assert REPO not in tmp_path.parents
    shutil.copyfile(REPO / "adapters" / "llama" / "extraction.py", tmp_path / "llama_extraction.py")
    (tmp_path / "user_script.py").write_text(USER_SCRIPT)
    shutil.copyfile(future_transformers.__file__, tmp_path / "future_transformers.py")
    spec = load_spec(REPO / "specs" / "llama.yaml")
    tiny = tiny_overrides(spec, options_from_spec(spec, output_dir=tmp_path / "unused"))
    script = ["user_script.py", "llama_extraction.py", json.dumps(tiny)]
    return subprocess.run(
        [sys.executable, "-S", "future_transformers.py", change, "--", *script],
        cwd=tmp_path,
        env=without_kadapt_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_generated_module_states_and_checks_its_tested_versions() -> None:
    """What it states; that it imports and builds its wrappers on the installed (tested) transformers
    is shown, in a user's interpreter, by ``test_generated_module_roundtrip.py`` (its llama cases)."""
    module = import_path(REPO / "adapters" / "llama" / "extraction.py", "llama_extraction_versions")
    assert module.TESTED_TRANSFORMERS == upstream.TESTED_TRANSFORMERS
    assert f"Tested with transformers {TESTED} and torch" in module.__doc__.replace("\n", " ")


@pytest.mark.parametrize(
    "change, stage",
    [("removed_helper", "import"), ("update_signature", "import"), ("attention_call", "wrapper")],
)
def test_a_generated_module_refuses_a_future_release(change: str, stage: str, tmp_path: Path) -> None:
    """At import (the library's contact points) or when it builds a wrapper (the model's own layers):
    the same error as kadapt's, raised as ContactPointMoved, before anything is traced."""
    proc = run_vendored(change, tmp_path)
    assert proc.returncode == 1
    assert ("imported" in proc.stdout) == (stage == "wrapper") and "built" not in proc.stdout
    error = re.split(r"(?:ContactPointMoved|LayersUnsupported): ", proc.stderr, maxsplit=1)[1]
    assert_clear_error("error: " + error, change)


# -- pinned patches: drifted upstream code is refused by generated modules too ------------------------


def _drifted_expand_kv(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek-V3's ``expand_kv`` (K1's pinned target) edited upstream."""
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    def expand_kv(self, kv_nope, k_rot):  # noqa: ANN001, ANN202 - an upstream edit
        return kv_nope, k_rot

    monkeypatch.setattr(deepseek.DeepseekV3Attention, "expand_kv", expand_kv)


def test_an_extraction_module_refuses_to_patch_drifted_upstream_code(monkeypatch: pytest.MonkeyPatch) -> None:
    module = import_path(REPO / "adapters" / "kimi_k25" / "extraction.py", "kimi_extraction_pins")
    with module.patches_applied():  # the pinned code as shipped: patched
        pass
    _drifted_expand_kv(monkeypatch)
    with pytest.raises(RuntimeError, match=r"patch K1: upstream drift: .*DeepseekV3Attention\.expand_kv"):
        with module.patches_applied():
            pass
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as deepseek

    assert deepseek.DeepseekV3Attention.expand_kv.__name__ == "expand_kv"  # nothing left installed


def test_a_tensorcast_profile_refuses_to_patch_drifted_upstream_code(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kimi-K2.5's profile pins P11 and P5 (simulation patches); a drifted P5 target is refused and
    nothing the profile installed stays."""
    from transformers.models.kimi_k25 import modeling_kimi_k25 as kimi

    for name in [n for n in sys.modules if n == "tensor_cast" or n.startswith("tensor_cast.")]:
        monkeypatch.delitem(sys.modules, name)
    module = import_path(REPO / "adapters" / "kimi_k25" / "tensorcast_profile.py", "kimi_profile_pins")
    config = json.loads((REPO / "specs" / "kimi_k25" / "config.json").read_text())
    original = kimi.Kimi_K25Model.__dict__["get_placeholder_mask"]

    def get_placeholder_mask(self, input_ids, inputs_embeds, image_features=None, video_features=None):  # noqa: ANN001, ANN202
        return original(self, input_ids, inputs_embeds, image_features, video_features)

    monkeypatch.setattr(kimi.Kimi_K25Model, "get_placeholder_mask", get_placeholder_mask)
    with pytest.raises(RuntimeError, match=r"patch P5: upstream drift: .*get_placeholder_mask"):
        module.hf_config_patch_method(config, None)
    assert module.installed_patches() == []
    assert kimi.Kimi_K25Model.__dict__["get_placeholder_mask"] is get_placeholder_mask


def test_apply_notes_a_release_outside_the_tested_set(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    tested = upstream.TESTED_TRANSFORMERS
    monkeypatch.setattr(upstream, "TESTED_TRANSFORMERS", ("5.0.0",))
    result = CliRunner().invoke(cli, ["apply", "llama", "--output-dir", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert (
        f"note: transformers {transformers.__version__} is not a release kadapt is tested with (5.0.0)"
        in (result.stderr)
    )
    monkeypatch.setattr(upstream, "TESTED_TRANSFORMERS", tested)
    assert (
        "not a release kadapt is tested with"
        not in CliRunner().invoke(cli, ["apply", "llama", "--output-dir", str(tmp_path)]).stderr
    )


# -- what the repository states about versions agrees with itself --------------------------------------


def test_tested_versions_are_stated_once_and_agree() -> None:
    """constraints.txt pins the newest tested transformers and the tested torch; the declared range
    (pyproject; every shipped spec's requires, or its tail from a later tested release) starts at the
    oldest; the compatibility page lists every contact point."""
    import tomllib

    pins = dict(
        line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines() if "==" in line
    )
    assert pins["transformers"] == upstream.TESTED_TRANSFORMERS[-1]
    assert pins["torch"] in upstream.TESTED_TORCH
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    declared = next(d for d in project["optional-dependencies"]["model"] if d.startswith("transformers"))
    assert declared == f"transformers>={upstream.TESTED_TRANSFORMERS[0].rsplit('.', 1)[0]},<6"
    # every shipped spec: the declared range, or the part of it from a later tested release on (a spec
    # whose patches are pinned to that release's code: Llama-4-Scout, 5.24)
    ranges = {f">={v.rsplit('.', 1)[0]},<6" for v in upstream.TESTED_TRANSFORMERS}
    assert declared.removeprefix("transformers") in ranges
    for path in sorted((REPO / "specs").glob("*.yaml")):
        requires = load_spec(path).raw.get("requires") or {}
        assert requires.get("transformers") in ranges, path.name
    page = (REPO / "docs" / "compatibility.md").read_text()
    for point in upstream.CONTACT_POINTS:
        assert f"| `{point.name}` |" in page, point.name
    assert f"transformers | {', '.join(upstream.TESTED_TRANSFORMERS)} |" in page


def test_doctor_prints_no_notice_of_its_own_probes() -> None:
    """The head_input_cast probe runs a Mamba forward; transformers' notices about that forward's kernels
    (causal_conv1d, mamba_ssm falling back to PyTorch) are not the user's and stay off doctor's output."""
    done = subprocess.run(
        [sys.executable, "-m", "kimi_adapter_core", "-q", "doctor"], capture_output=True, text=True, cwd=REPO
    )
    assert "ok     head_input_cast" in done.stdout
    assert "falling back" not in done.stderr + done.stdout, done.stderr
