"""``kadapt simulate --images``: image placeholder tokens against transformers' own Kimi-K2.5 processor
and vision model, the encoder's cost on the full config traced on meta (per-image attention), the
merged prefill, errors and the JSON/text reports."""

from __future__ import annotations

import ast
import importlib.util
import json
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner, Result
from fixtures.spec_files import KIMI_SPEC, TINY_KIMI, tiny_kimi_config
from transformers.models.kimi_k25.processing_kimi_k25 import Kimi_K25Processor

from kimi_adapter_core.backends.simulation.estimate.cost import price
from kimi_adapter_core.backends.simulation.estimate.simulator import simulate
from kimi_adapter_core.backends.simulation.estimate.vision import (
    images_per_rank,
    simulate_images,
    trace_vision,
)
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.tracer import Op
from kimi_adapter_core.backends.simulation.report.simulation import image_prefill_text
from kimi_adapter_core.backends.simulation.tables.device import get_device
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import UsageError
from kimi_adapter_core.loading import load_config, load_model
from kimi_adapter_core.vision.images import ImageBatch, image_batch
from kimi_adapter_core.vision.tower import vision_arch

pytestmark = pytest.mark.compat  # run by .ci/compat: --images on every supported transformers release
INPUTS = model_inputs(KIMI_SPEC, None)
VISION = INPUTS.arch.vision
assert VISION is not None
HEADS, HEAD_DIM, LAYERS = 16, 1152 // 16, 27  # MoonViT at Kimi-K2.5's size


def run(*args: str) -> Result:
    return CliRunner().invoke(cli, list(args))


# -- image tokens: transformers' processor and vision model ----------------------------------------


def kimi_image_processor() -> tuple[Any, Any]:
    """transformers' ``Kimi_K25ImageProcessor`` sizing - ``navit_resize``, ``get_number_of_image_patches``
    and the class defaults they read - compiled from transformers' own source file. The module imports
    torchvision for its pixel transforms, which has no CPU build for torch 2.13's here (the CUDA wheel
    fails to load its ops); the sizing is plain arithmetic that never touches it."""
    found = importlib.util.find_spec("transformers.models.kimi_k25.image_processing_kimi_k25")
    assert found is not None and found.origin is not None
    tree = ast.parse(Path(found.origin).read_text(encoding="utf-8"))
    navit = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "navit_resize")
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Kimi_K25ImageProcessor")
    method = next(
        n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "get_number_of_image_patches"
    )
    defaults = {}
    for node in cls.body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            try:
                defaults[node.targets[0].id] = ast.literal_eval(node.value)
            except ValueError:  # enum members and class references: not sizing
                continue
    module = ast.fix_missing_locations(ast.Module([ast.Import([ast.alias("math")]), navit, method], []))
    namespace: dict[str, Any] = {}
    exec(compile(module, found.origin, "exec"), namespace)  # noqa: S102 - transformers' own source
    processor = types.SimpleNamespace(**defaults)
    processor.get_number_of_image_patches = types.MethodType(
        namespace["get_number_of_image_patches"], processor
    )
    assert (processor.patch_size, processor.merge_size) == (VISION.patch_size, VISION.merge_h)
    return processor, namespace["navit_resize"]


def processor_tokens(processor: Any, height: int, width: int) -> tuple[int, int]:
    """(placeholder tokens, patches) ``Kimi_K25Processor._get_num_multimodal_tokens`` gives one image."""
    owner = types.SimpleNamespace(
        image_processor=processor, _merge_kwargs=lambda **_: {"images_kwargs": {}, "videos_kwargs": {}}
    )
    data = Kimi_K25Processor._get_num_multimodal_tokens(owner, image_sizes=[[height, width]])
    return data.num_image_tokens[0], data.num_image_patches[0]


@pytest.mark.parametrize("size", [(448, 448), (28, 28), (896, 1344), (1092, 1932), (1792, 1792), (56, 7168)])
def test_image_tokens_match_the_kimi_processor(size: tuple[int, int]) -> None:
    processor, navit_resize = kimi_image_processor()
    images = image_batch(KIMI_SPEC, INPUTS.arch.vision, 1, size)
    tokens, patches = processor_tokens(processor, *size)
    assert (images.tokens_per_image, images.patches_per_image) == (tokens, patches)
    _, (pad_h, pad_w) = navit_resize(*size, 14, 2, processor.max_patches, processor.size["max_height"])
    assert images.grid == (pad_h // 14, pad_w // 14)
    assert images.feature_bytes_per_image == tokens * 7168 * 2


@pytest.mark.parametrize("size", [(1080, 1920), (450, 448), (27, 30)])
def test_unaligned_size_names_the_processors_padded_size(size: tuple[int, int]) -> None:
    processor, navit_resize = kimi_image_processor()
    (height, width), (pad_h, pad_w) = navit_resize(
        *size, 14, 2, processor.max_patches, processor.size["max_height"]
    )
    assert (height, width) == size  # within the processor's budget: padded, not resized
    with pytest.raises(UsageError, match=f"pads this image to {pad_h}x{pad_w}, pass that"):
        image_batch(KIMI_SPEC, INPUTS.arch.vision, 1, size)
    padded = image_batch(KIMI_SPEC, INPUTS.arch.vision, 1, (pad_h, pad_w))
    assert padded.tokens_per_image == processor_tokens(processor, *size)[0]


def test_placeholders_equal_the_rows_get_image_features_returns() -> None:
    """A tiny random-weight Kimi-K2.5 on CPU: one feature row per placeholder token, per image."""
    overrides = {**TINY_KIMI, "projection_hidden_size": TINY_KIMI["vision_config.vt_hidden_size"]}
    torch.manual_seed(0)
    model = load_model(KIMI_SPEC, device="cpu", config=load_config(KIMI_SPEC, overrides=overrides)).eval()
    tiny = vision_arch(tiny_kimi_config()["vision_config"], TINY_KIMI["text_config.hidden_size"])
    for sizes in ([(56, 84)], [(28, 28), (112, 56), (56, 84)]):
        batches = [ImageBatch(tiny, 1, h, w) for h, w in sizes]
        grid = torch.tensor([[1, *b.grid] for b in batches])
        pixels = torch.randn(sum(b.patches_per_image for b in batches), 3, 14, 14)
        with torch.no_grad():
            rows = model.get_image_features(pixels, grid).pooler_output
        assert [r.shape for r in rows] == [(b.tokens_per_image, 64) for b in batches]
        owner = types.SimpleNamespace(image_processor=types.SimpleNamespace(merge_size=2), image_token="<i>")
        placeholders = [
            Kimi_K25Processor.replace_image_token(owner, {"image_grid_thw": grid}, i).count("<i>")
            for i in range(len(batches))
        ]
        assert placeholders == [b.tokens_per_image for b in batches]


# -- encoder cost: full config on meta -------------------------------------------------------------


def traced(images: int, size: tuple[int, int], *, tp: int = 1, batch: int = 1) -> list[Op]:
    dep = Deployment(Parallel(tp, 1, 1), batch, 64, 0, False)
    return trace_vision(KIMI_SPEC, INPUTS, dep, image_batch(KIMI_SPEC, INPUTS.arch.vision, images, size))


def flops(ops: list[Op], kind: str, scope: str | None = None) -> float:
    return sum(o.flops * o.repeat for o in ops if o.kind == kind and scope in (None, o.scope))


@pytest.fixture(scope="module")
def traces() -> dict[str, list[Op]]:
    return {"1x448": traced(1, (448, 448)), "4x448": traced(4, (448, 448)), "1x896": traced(1, (896, 896))}


def test_encoder_attention_is_full_attention_within_each_image(traces: dict[str, list[Op]]) -> None:
    one, four, large = (traces[k] for k in ("1x448", "4x448", "1x896"))
    patches = 32 * 32
    per_image = 4 * HEADS * patches**2 * HEAD_DIM * LAYERS  # QK^T + PV, every patch sees every patch
    assert flops(one, "attention") == per_image
    assert flops(four, "attention") == 4 * per_image  # per image, not over the 4096 concatenated patches
    assert flops(large, "attention") == 16 * per_image  # quadratic in one image's patches
    (kernel,) = [o for o in four if o.kind == "attention"]
    assert (kernel.repeat, kernel.attrs["batch"], kernel.attrs["seq"]) == (LAYERS, 4, patches)


def test_encoder_gemms_scale_with_patches(traces: dict[str, list[Op]]) -> None:
    one, four, large = (traces[k] for k in ("1x448", "4x448", "1x896"))
    layer = flops(one, "matmul", "vision_layer")
    hidden, width = 1152, 4304
    assert layer == 2 * 1024 * (4 * hidden * hidden + 2 * hidden * width) * LAYERS  # qkv, proj, fc1, fc2
    assert flops(four, "matmul", "vision_layer") == flops(large, "matmul", "vision_layer") == 4 * layer
    patch = next(o for o in one if o.module.endswith("patch_embed.proj"))  # the Conv2d as a GEMM
    assert (patch.kind, patch.attrs["m"], patch.attrs["n"], patch.attrs["k"]) == ("matmul", 1024, 1152, 588)
    projector = flops(one, "matmul", "projector")
    assert projector == 2 * 256 * (4608 * 4608 + 4608 * 7168)  # 2x2 merge: 256 rows of 4 x 1152
    assert flops(four, "matmul", "projector") == 4 * projector
    h200 = get_device("h200", None)

    def seconds(ops: list[Op]) -> float:
        return sum(price(o, h200).total for o in ops if o.scope in ("vision_encoder", "vision_layer"))

    assert seconds(one) < seconds(four) < 4.2 * seconds(one)
    assert seconds(four) < seconds(large)  # same GEMMs, 4x the attention


def test_images_of_a_dp_group_spread_over_its_tp_ranks() -> None:
    images = image_batch(KIMI_SPEC, INPUTS.arch.vision, 4, (448, 448))
    dep = Deployment(Parallel(8, 2, 1), 8, 64, 0, False)  # 4 queries per DP group x 4 images = 16
    assert images_per_rank(images, dep) == 2
    ops = traced(4, (448, 448), tp=8, batch=4)  # 16 images over 8 ranks
    assert next(o for o in ops if o.kind == "attention").attrs["batch"] == 2
    gather = next(o for o in ops if o.name == "tp_all_gather(image_features)")
    assert gather.comm == {"collective": "all_gather", "bytes": 16 * 256 * 7168 * 2, "group": 8}


# -- the merged prefill and the reports -------------------------------------------------------------


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    result = run(
        "simulate", "kimi_k25", "--device", "h200", "--tp", "8", "--ep", "8", "--images", "2",
        "--query-len", "64", "--format", "json",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


def test_json_reports_each_part_and_the_merged_prompt(document: dict[str, Any]) -> None:
    image = document["image_prefill"]
    assert (image["image_size"], image["tokens_per_image"], image["image_tokens_per_query"]) == (
        [448, 448],  # the spec's abi.vision image
        256,
        512,
    )
    assert document["query_len"] == 64 + 512 and image["text_tokens_per_query"] == 64
    parts = image["time_s"]
    assert parts["total"] == pytest.approx(parts["encoder"] + parts["projector"] + parts["merged_prefill"])
    assert parts["merged_prefill"] == pytest.approx(parts["feature_merge"] + parts["text_prefill"])
    assert document["step_time_s"] == pytest.approx(parts["total"])
    assert min(parts.values()) > 0
    layer_ops = [op for op in document["ops"] if op["scope"] == "vision_layer"]
    assert layer_ops and {op["count"] for op in layer_ops} == {LAYERS}
    assert document["memory_per_device"]["vision_cache_bytes"] == 2 * 256 * 7168 * 2


def test_merged_prefill_is_the_text_prefill_with_placeholders(document: dict[str, Any]) -> None:
    h200 = get_device("h200", None)
    plain = simulate(INPUTS, KIMI_SPEC, Deployment(Parallel(8, 1, 8), 1, 64 + 512, 0, False), h200)
    assert document["image_prefill"]["time_s"]["text_prefill"] == pytest.approx(plain.step_time)


def test_text_report_shows_encoder_projector_merged_prefill_and_total() -> None:
    h200 = get_device("h200", None)
    images = image_batch(KIMI_SPEC, INPUTS.arch.vision, 1, (896, 896))
    prefill = simulate_images(INPUTS, KIMI_SPEC, Deployment(Parallel(1, 1, 1), 1, 32, 0, False), h200, images)
    assert prefill.images_per_rank == 1 and prefill.simulation.deployment.query_len == 32 + 1024
    text = image_prefill_text(prefill, top=5)
    assert "1 image of 896x896 per query (64x64 patches of 14 px, merge 2x2 -> 1024 tokens each)" in text
    parts = {
        "vision encoder": prefill.seconds("encoder"),
        "projector": prefill.seconds("projector"),
        "merged prefill": prefill.merged_prefill_s,
        "total": prefill.total_s,
    }
    lines = text.splitlines()
    for label, seconds in parts.items():
        assert seconds > 0
        assert any(line.startswith(f"  {label} ") and f"{seconds * 1e3:.3f} ms" in line for line in lines), (
            label
        )


# -- usage errors ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["llama", "--images", "1"], "spec llama has no vision tower"),
        (["kimi_k25", "--images", "1", "--image-size", "450x448"], "pads this image to 476x448"),
        (["kimi_k25", "--image-size", "448x448"], "--image-size applies to --images N"),
        (["kimi_k25", "--images", "1", "--image-size", "448"], "is not HEIGHTxWIDTH"),
        (["kimi_k25", "--images", "0"], "--images"),
        (["kimi_k25", "--images", "1", "--decode"], "--images prices a prefill step; --decode"),
        (["kimi_k25", "--images", "1", "--sweep"], "--images prices a prefill step; --sweep"),
    ],
)
def test_bad_image_options_are_usage_errors(args: list[str], message: str) -> None:
    for command in ("simulate", "plan"):
        if command == "plan" and {"--decode", "--sweep"} & set(args):  # simulate's options
            continue
        result = run(command, *args, "--format", "json")
        assert result.exit_code == 2, (command, result.output)
        assert message in result.output and not result.stdout.startswith("{")
