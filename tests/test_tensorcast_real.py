"""The generated TensorCast profiles, run unmodified in a real TensorCast checkout.

Skipped unless two environment variables point at one (TensorCast is not on PyPI and pins its own
torch/transformers, so it lives in its own venv):

    KADAPT_TENSORCAST=/path/to/msmodeling-checkout            # its tree root (cli/, tensor_cast/)
    KADAPT_TENSORCAST_PYTHON=/path/to/venv/bin/python         # a python that imports tensor_cast

Every shipped spec's committed profile runs TensorCast's ``text_generate`` CLI through the profile's
own ``main()`` (``python adapters/<spec>/tensorcast_profile.py [--replace-builtin] MODEL_DIR ...`` from
the tree root), offline, for a text prefill and a text decode step, on the shortened config-only
model directory of ``test_tensorcast_profiles.py`` (the hub-like remote code for
``kimi_k25_remote``). Then the loud failures: a profile with the first generated field renames,
one whose config bridge fails inside TensorCast (which only logs it), and one generated for another
transformers range. Run with ``-s`` to see the timings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest
from test_tensorcast_profiles import REPO, SPECS, write_model_dir

from kimi_adapter_core.generate.simulation import (
    PATH_FIELDS,
    PROFILE_FIELDS,
    TENSORCAST_MLA_FIELDS,
    TENSORCAST_MOE_FIELDS,
)
from kimi_adapter_core.spec import load_spec

CHECKOUT = os.environ.get("KADAPT_TENSORCAST")
PYTHON = os.environ.get("KADAPT_TENSORCAST_PYTHON")
pytestmark = pytest.mark.skipif(
    not (CHECKOUT and PYTHON),
    reason="set KADAPT_TENSORCAST (a TensorCast checkout) and KADAPT_TENSORCAST_PYTHON (its venv's python)",
)
DEVICE = "ATLAS_800_A3_560T_128G_DIE"
EXPERTS = 8  # routed experts kept per MoE layer (TensorCast's meta build makes one module each)
MODES = {
    "prefill": ["--num-queries", "2", "--query-length", "128"],
    "decode": ["--num-queries", "2", "--query-length", "1", "--context-length", "128", "--decode"],
}
TOTAL = re.compile(r"Total time for analytic:\s*([\d.]+)\s*(ns|us|ms|s)\b")
UNITS = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}


def has_builtin(model_type: str) -> bool:
    """TensorCast registers a builtin profile per ``builtin_model/<model_type>.py``."""
    return (
        Path(CHECKOUT or "") / "tensor_cast" / "transformers" / "builtin_model" / f"{model_type}.py"
    ).exists()


def run_profile(
    profile: Path, model_dir: Path, args: list[str], *, replace: bool
) -> subprocess.CompletedProcess:
    command = [PYTHON or "", str(profile), *(["--replace-builtin"] if replace else []), str(model_dir)]
    command += ["--device", DEVICE, "--num-devices", "1", *args]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    return subprocess.run(command, cwd=CHECKOUT, env=env, capture_output=True, text=True, timeout=1200)


def total_ms(output: str) -> float:
    match = TOTAL.search(output)
    assert match, output[-3000:]
    return float(match.group(1)) * UNITS[match.group(2)]


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tensorcast_models")
    return {p.stem: write_model_dir(p.stem, root / p.stem, experts=EXPERTS) for p in SPECS}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("spec_name", [p.stem for p in SPECS])
def test_profile_runs_unmodified_in_tensorcast(
    spec_name: str, mode: str, model_dirs: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
    model_type = (spec.backends.get("simulation") or {}).get("model_type", spec.gate.model_type)
    profile = REPO / "adapters" / spec_name / "tensorcast_profile.py"
    result = run_profile(profile, model_dirs[spec_name], MODES[mode], replace=has_builtin(model_type))
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-4000:]
    assert "ProfileError" not in output and "Failed to apply HF config patches" not in output, output[-4000:]
    ms = total_ms(output)
    assert ms > 0
    with capsys.disabled():
        how = "replacing TensorCast's builtin" if has_builtin(model_type) else "registered (no builtin)"
        print(f"\n[tensorcast] {spec_name:16} {mode:7} {ms:9.3f} ms/step  ({how})")


def test_kadapt_knows_tensorcasts_fields() -> None:
    """kadapt's copy of TensorCast's field names (profile fields, MLA/MoE field-name dataclasses and
    which of them are optional) is what this checkout defines."""
    script = """
import dataclasses, json, typing
from tensor_cast.model_config import MlaFieldNames, MoEFieldNames
from tensor_cast.transformers.custom_model_registry import ModelProfile
def table(cls):
    hints = typing.get_type_hints(cls)
    return {f.name: type(None) not in typing.get_args(hints[f.name]) for f in dataclasses.fields(cls)}
print(json.dumps({"mla": table(MlaFieldNames), "moe": table(MoEFieldNames),
                  "profile": [f.name for f in dataclasses.fields(ModelProfile)]}))
"""
    result = subprocess.run(
        [PYTHON or "", "-c", script], cwd=CHECKOUT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found["mla"] == TENSORCAST_MLA_FIELDS
    assert found["moe"] == TENSORCAST_MOE_FIELDS
    ours = {name for name, _ in (*PROFILE_FIELDS, *PATH_FIELDS)}
    ours |= {"hf_config_patch_method", "patch_method", "custom_expert_module_type", "mla_module_class_type"}
    assert ours <= set(found["profile"]), ours - set(found["profile"])


def broken_copy(spec_name: str, tmp_path: Path, old: str, new: str) -> Path:
    text = (REPO / "adapters" / spec_name / "tensorcast_profile.py").read_text(encoding="utf-8")
    assert old in text
    path = tmp_path / f"{spec_name}_broken.py"
    path.write_text(text.replace(old, new), encoding="utf-8")
    return path


def test_a_swap_tensorcast_would_skip_stops_the_run(model_dirs: dict[str, Path], tmp_path: Path) -> None:
    """The field renames kimi_k25 first shipped with (copied from the remote spec): TensorCast would
    skip every MLA swap with a PatchReport entry; the profile's post-load check stops the run."""
    profile = broken_copy(
        "kimi_k25",
        tmp_path,
        '"mla_field_names_override": {},',
        '"mla_field_names_override": {"q_proj": "q_a_proj", "qk_head_dim": "q_head_dim"},',
    )
    result = run_profile(profile, model_dirs["kimi_k25"], MODES["prefill"], replace=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "ProfileError" in output and "Total time for analytic" not in output
    assert (
        "a DeepseekV3Attention, lacks q_head_dim (its qk_head_dim), so TensorCast would skip its swap"
        in output
    )


def test_a_config_patch_failure_is_raised_after_the_build(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """TensorCast catches what ``hf_config_patch_method`` raises and logs a warning; the profile
    raises it again from ``patch_method`` once the model is built, with the original cause."""
    profile = broken_copy(
        "kimi_k25",
        tmp_path,
        '_copy(hf_config, "text_config.n_shared_experts", "n_shared_experts", fallback=1)',
        '_copy(hf_config, "text_config.no_such_key", "n_shared_experts")',
    )
    result = run_profile(profile, model_dirs["kimi_k25"], MODES["prefill"], replace=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Total time for analytic" not in output
    assert "hf_config_patch_method failed before TensorCast built the model" in output
    assert "text_config.no_such_key is not in the config" in output


def test_another_transformers_range_is_refused_before_tensorcast_runs(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """TensorCast pins transformers 5.13.1, the spec says >=5.23: a profile whose range excludes the
    installed transformers refuses to run instead of pricing a different model."""
    profile = broken_copy(
        "llama", tmp_path, '{"transformers": ">=5.23,<6"}', '{"transformers": ">=5.13,<5.14"}'
    )
    result = run_profile(profile, model_dirs["llama"], MODES["decode"], replace=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Total time for analytic" not in output
    assert "was generated for transformers >=5.13,<5.14" in output
