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
transformers range.

The vision path: every spec with a vision tower runs an image prefill (``--image-batch-size``,
``--image-height``, ``--image-width``) next to the same text-only prefill, with TensorCast's
``--dump-input-shapes`` table read for the patch embedding, the vision attention, the projector and
the text tokens the image adds; then what breaks without the profile's image sizing (TensorCast's
fallback imports torchvision, whose only wheel here is CUDA-linked) and without its vision-attention
tags. Run with ``-s`` to see the timings.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import pytest
from test_tensorcast_profiles import REPO, SPECS, VISION_LAYERS, short_config, write_model_dir

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


# -- the vision path: an image prefill through TensorCast's own image inputs -------------------------

VISION_SPECS = [p.stem for p in SPECS if "vision_layers" in load_spec(p).module_paths]
PREFILL_ONE = ["--num-queries", "1", "--query-length", "128", "--dump-input-shapes"]
QUERY_TOKENS = 128
MARKERS = 2  # TensorCast's generic image inputs add 2 tokens per image (Qwen-VL's start and end)
# One row of TensorCast's --dump-input-shapes table: op, input shapes, total, average, calls.
ROW = re.compile(
    r"^(?P<op>[a-z_][\w.]*)\s+(?P<shapes>\[.*\])\s+(?P<total>[\d.]+)(?P<unit>ns|us|ms|s)\s+\S+\s+(?P<calls>\d+)\s*$",
    re.M,
)
SHAPE = re.compile(r"\[([^\[\]]*)\]")


class Op(NamedTuple):
    name: str
    shapes: tuple[tuple[int, ...], ...]
    ms: float
    calls: int


def ops(output: str) -> list[Op]:
    """TensorCast's per-op table as printed with ``--dump-input-shapes``."""
    rows = []
    for m in ROW.finditer(output):
        shapes = tuple(
            tuple(int(d) for d in dims.split(",") if d.strip()) for dims in SHAPE.findall(m["shapes"])
        )
        rows.append(Op(m["op"], shapes, float(m["total"]) * UNITS[m["unit"]], int(m["calls"])))
    assert rows, output[-3000:]
    return rows


def named(output: str, name: str) -> list[Op]:
    return [op for op in ops(output) if op.name == name]


def text_tokens(output: str) -> int:
    """Tokens the text model prefilled: the rows of its (MLA) attention's query."""
    (mla,) = {op.shapes[0][0] for op in named(output, "tensor_cast.multihead_latent_attention.default")}
    return mla


class VisionFacts(NamedTuple):
    patch: int  # pixels a side
    merge: tuple[int, int]  # patches pooled into one image token
    width: int  # vision hidden size
    text_width: int

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Patch rows and columns of an image padded up to whole merge blocks (the processor's)."""
        block_h, block_w = self.patch * self.merge[0], self.patch * self.merge[1]
        return -(-height // block_h) * self.merge[0], -(-width // block_w) * self.merge[1]


def vision_facts(spec_name: str) -> VisionFacts:
    raw = short_config(spec_name)
    vision, text = raw["vision_config"], raw["text_config"]
    merge = tuple(vision["merge_kernel_size"])
    return VisionFacts(vision["patch_size"], merge, vision["vt_hidden_size"], text["hidden_size"])


def image_args(count: int, height: int, width: int) -> list[str]:
    return ["--image-batch-size", str(count), "--image-height", str(height), "--image-width", str(width)]


@pytest.fixture(scope="module")
def prefill(model_dirs: dict[str, Path]) -> Callable[[str, tuple[int, int, int] | None], str]:
    """``prefill(spec, (images, height, width) or None)``: TensorCast's output for one query of
    ``QUERY_TOKENS`` tokens, with the images; each run once per module."""
    outputs: dict[tuple[str, tuple[int, int, int] | None], str] = {}

    def run(spec_name: str, images: tuple[int, int, int] | None) -> str:
        if (spec_name, images) not in outputs:
            spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
            model_type = (spec.backends.get("simulation") or {}).get("model_type", spec.gate.model_type)
            profile = REPO / "adapters" / spec_name / "tensorcast_profile.py"
            args = [*PREFILL_ONE, *(image_args(*images) if images else [])]
            result = run_profile(profile, model_dirs[spec_name], args, replace=has_builtin(model_type))
            output = result.stdout + result.stderr
            assert result.returncode == 0, output[-4000:]
            assert "ProfileError" not in output, output[-4000:]
            outputs[(spec_name, images)] = output
        return outputs[(spec_name, images)]

    return run


@pytest.mark.parametrize("spec_name", VISION_SPECS)
def test_image_prefill_runs_the_vision_path(
    spec_name: str, prefill: Callable[..., str], capsys: pytest.CaptureFixture[str]
) -> None:
    """One 448x448 image: TensorCast's flat pixel rows reach the patch embedding (1024 patches of
    3x14x14), the text model prefills the query plus the image's 256 tokens (and TensorCast's 2
    markers), and the step costs more than the text-only prefill of the same query."""
    facts = vision_facts(spec_name)
    text, image = prefill(spec_name, None), prefill(spec_name, (1, 448, 448))
    rows, cols = facts.grid(448, 448)
    patches, tokens = rows * cols, rows * cols // (facts.merge[0] * facts.merge[1])
    assert (patches, tokens) == (1024, 256)
    pixels = (patches, 3 * facts.patch**2)
    assert [op.name for op in ops(image) if pixels in op.shapes] == ["aten.addmm.default"]  # P11's linear
    assert not [op for op in ops(text) if pixels in op.shapes]
    assert text_tokens(text) == QUERY_TOKENS
    assert text_tokens(image) == QUERY_TOKENS + tokens + MARKERS
    text_ms, image_ms = total_ms(text), total_ms(image)
    assert image_ms > text_ms
    with capsys.disabled():
        print(f"\n[tensorcast] {spec_name:16} prefill {text_ms:8.3f} ms, +448x448 image {image_ms:8.3f} ms")


def test_the_native_vision_encoder_and_projector_are_priced(prefill: Callable[..., str]) -> None:
    """kimi_k25 (transformers' MoonViT): each vision layer's attention is priced by TensorCast's own
    attention op over the image's 1024 patches (text attention is MLA, so the text-only run has
    none), and the projector maps 256 merged rows of 4x1152 to the text width."""
    facts = vision_facts("kimi_k25")
    text, image = prefill("kimi_k25", None), prefill("kimi_k25", (1, 448, 448))
    attention = named(image, "tensor_cast.attention.default")
    assert [(op.shapes[0], op.calls) for op in attention] == [((1024, facts.width), VISION_LAYERS)]
    assert not named(text, "tensor_cast.attention.default")
    merged = facts.width * facts.merge[0] * facts.merge[1]
    projector = [op for op in ops(image) if (256, merged) in op.shapes]
    assert any((merged, facts.text_width) in op.shapes for op in projector), projector


def test_image_sizes_are_padded_to_whole_merge_blocks(prefill: Callable[..., str]) -> None:
    """Two 460x300 images: the profile's sizing pads each to 476x308 (34x22 patches, 187 tokens);
    TensorCast's own fallback, Qwen2-VL's smart_resize, would round 460 down to 448 (704 patches)."""
    facts = vision_facts("kimi_k25")
    image = prefill("kimi_k25", (2, 460, 300))
    assert facts.grid(460, 300) == (34, 22)
    attention = named(image, "tensor_cast.attention.default")
    assert [(op.shapes[0], op.calls) for op in attention] == [((748, facts.width), 2 * VISION_LAYERS)]
    merged = facts.width * facts.merge[0] * facts.merge[1]
    assert any((2 * 187, merged) in op.shapes for op in ops(image))
    assert text_tokens(image) == QUERY_TOKENS + 2 * (187 + MARKERS)


def test_tensorcasts_own_image_sizing_is_what_needs_torchvision(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """The dependency the profile routes around: without its image sizing TensorCast sizes a
    kimi_k25 image with Qwen2-VL's smart_resize, from a transformers module that imports
    torchvision, and the only torchvision wheel here (0.28.0 on PyPI) is linked against CUDA torch."""
    probe = subprocess.run([PYTHON or "", "-c", "import torchvision"], capture_output=True, timeout=600)
    if probe.returncode == 0:
        pytest.skip("torchvision imports in TensorCast's venv: its own image sizing can run there")
    profile = broken_copy("kimi_k25", tmp_path, "    install_image_sizing()  #", "    #")
    result = run_profile(
        profile, model_dirs["kimi_k25"], [*PREFILL_ONE, *image_args(1, 448, 448)], replace=True
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Total time for analytic" not in output
    assert "image_processing_qwen2_vl" in output and "No module named 'torchvision'" in output


def test_untagged_vision_attention_fails_inside_tensorcast(
    model_dirs: dict[str, Path], tmp_path: Path
) -> None:
    """Without ``tag_vision_attention`` TensorCast's attention function meets transformers' vision
    attention (``vision_tower.layers.N.attn``, not its ``blocks.*.attn``) with no layer index."""
    profile = broken_copy("kimi_k25", tmp_path, "        tag_vision_attention(model)\n", "")
    result = run_profile(
        profile, model_dirs["kimi_k25"], [*PREFILL_ONE, *image_args(1, 448, 448)], replace=True
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0 and "Total time for analytic" not in output
    assert "'Kimi_K25VisionAttention' object has no attribute 'layer_idx'" in output
