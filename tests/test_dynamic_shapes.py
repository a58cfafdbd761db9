"""Dynamic dimensions (``abi.dynamic``): one prefill graph for every prompt length and batch in range.

The end-to-end checks run ``verify``: a tiny model is exported with symbolic sizes, the saved JSON is
loaded by torch_ir, bound to each call's shapes and executed against transformers at the traced sizes
and at a smaller batch and prompt, and a prompt past the range must be refused before execution.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import sympy
from click.testing import CliRunner

from kimi_adapter_core.backends.extraction import ExtractionOptions, options_from_spec
from kimi_adapter_core.backends.extraction.equivalence.roundtrip import verify
from kimi_adapter_core.backends.extraction.equivalence.verdict import Check, VerifyReport
from kimi_adapter_core.backends.extraction.ir.convert import Symbols
from kimi_adapter_core.backends.extraction.runtime.symbolic import (
    DimRange,
    bind_sizes,
    evaluate,
    substitute,
)
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec

PREFILL = [("input_ids", ("batch", "prefill_len")), ("mask", ("batch", 1, "prefill_len", "prefill_len"))]
RANGES = {"batch": DimRange(1, 4), "prefill_len": DimRange(1, 64)}


def test_expressions_evaluate_as_integer_arithmetic() -> None:
    sizes = {"batch": 3, "prefill_len": 10}
    assert evaluate("2*batch*prefill_len", sizes) == 60
    assert evaluate("(prefill_len + -1)//4 + prefill_len%3", sizes) == 3
    assert evaluate("max(batch, 8) - min(prefill_len, 2)", sizes) == 6
    assert substitute([{"expr": "batch"}, -1, {"expr": "prefill_len + 1"}], sizes) == [3, -1, 11]
    assert substitute("floor", sizes) == "floor"  # string attributes are never expressions


@pytest.mark.parametrize(
    "text", ["__import__('os').getcwd()", "batch ** 2", "batch / 2", "open", "[batch]", "x", "2*"]
)
def test_anything_but_integer_arithmetic_is_refused(text: str) -> None:
    with pytest.raises(KadaptError, match="symbolic size"):
        evaluate(text, {"batch": 2})


def test_written_expressions_evaluate_like_sympy() -> None:
    """What the converter writes for torch's size expressions means what sympy means."""
    from torch.utils._sympy.functions import FloorDiv, Max, Mod

    b, s = sympy.Symbol("s43", integer=True, positive=True), sympy.Symbol("s54", integer=True, positive=True)
    symbols = Symbols({b: "batch", s: "prefill_len"})
    expressions = [
        2 * b * s,
        s - 1,
        8 * b * s + 3 * s + 7,
        FloorDiv(s + 3, 4),
        Mod(s, 5) + b,
        Max(1, s - 4),
        (s + 1) * (b + 2),
        s**2,
    ]
    rng = random.Random(7)
    for expr in expressions:
        text = symbols.text(expr)
        for _ in range(20):
            sizes = {"batch": rng.randint(1, 9), "prefill_len": rng.randint(1, 99)}
            expected = int(expr.subs({b: sizes["batch"], s: sizes["prefill_len"]}))
            assert evaluate(text, sizes) == expected, (expr, text, sizes)
    with pytest.raises(KadaptError, match="depends on no dynamic ABI dimension"):
        symbols.text(sympy.Symbol("u0") + 1)


def test_sizes_bind_from_inputs_and_are_checked_before_execution() -> None:
    assert bind_sizes(PREFILL, [(2, 7), (2, 1, 7, 7)], RANGES, graph="prefill") == {
        "batch": 2,
        "prefill_len": 7,
    }
    # one error naming the input, its expected and its received shape, and why
    expected = r"expected shape \[batch, 1, prefill_len, prefill_len\], got"
    with pytest.raises(
        KadaptError,
        match=r"^prefill input input_ids: expected shape \[batch, prefill_len\], got \[2, 65\]: "
        r"dim 1 \(prefill_len\) is 65, outside the graph's range 1..64$",
    ):
        bind_sizes(PREFILL, [(2, 65), (2, 1, 65, 65)], RANGES, graph="prefill")
    with pytest.raises(
        KadaptError, match=rf"mask: {expected} \[2, 1, 6, 7\]: dim 2 \(prefill_len\) is 6, but"
    ):
        bind_sizes(PREFILL, [(2, 7), (2, 1, 6, 7)], RANGES, graph="prefill")
    with pytest.raises(
        KadaptError, match=rf"mask: {expected} \[2, 2, 7, 7\]: dim 1 must be 1 \(static\), got 2"
    ):
        bind_sizes(PREFILL, [(2, 7), (2, 2, 7, 7)], RANGES, graph="prefill")
    with pytest.raises(KadaptError, match=rf"mask: {expected} \[2, 7, 7\]: must have 4 dims, got 3"):
        bind_sizes(PREFILL, [(2, 7), (2, 7, 7)], RANGES, graph="prefill")
    with pytest.raises(KadaptError, match=r"prefill graph takes 2 inputs \(input_ids, mask\), got 1"):
        bind_sizes(PREFILL, [(2, 7)], RANGES, graph="prefill")


def test_dynamic_sizes_are_checked_with_the_spec() -> None:
    spec = load_spec("llama")
    with pytest.raises(KadaptError, match="dynamic batch needs batch >= 2"):
        options_from_spec(spec, output_dir="/tmp/kadapt-dyn-unused", batch=1, dynamic=["batch"])
    options = options_from_spec(spec, output_dir="/tmp/kadapt-dyn-unused", batch=4, dynamic=["prefill_len"])
    assert options.dynamic_ranges == {"prefill_len": DimRange(1, spec.abi.prefill_len)}


def test_cli_refuses_contradictory_flags() -> None:
    result = CliRunner().invoke(cli, ["apply", "llama", "--dynamic", "batch", "--static"])
    assert result.exit_code == 2 and "contradict" in result.output
    result = CliRunner().invoke(cli, ["apply", "llama", "--backend", "none", "--dynamic", "batch"])
    assert result.exit_code == 2 and "need --backend extraction" in result.output


def _dynamic(name: str, tmp_path: Path, *, batch: int):
    spec = load_spec(name)
    options = options_from_spec(spec, output_dir=tmp_path, batch=batch, dynamic=["batch", "prefill_len"])
    return spec, dataclasses.replace(options, verify_dtypes=("float32",), verify_decode_steps=6)


def _assert_serves_the_range(report: VerifyReport, options: ExtractionOptions) -> dict[str, Check]:
    """The saved symbolic graphs equal transformers at the traced sizes and at batch 1 with a shorter
    prompt, and refuse a batch and a prompt past the range before execution; returns the checks."""
    checks = {check.name: check for check in report.checks}
    assert report.passed, report.render()
    assert "greedy generation (batch 1, prompt 3)" in checks
    assert "prefill logits (batch 1, prompt 3)" in checks
    for size, too_big in (("batch", 3), ("prefill_len", options.verify_prefill_len + 1)):
        refused = checks[f"{size} {too_big} refused before execution"]
        assert f"({size}) is {too_big}, outside the graph's range" in refused.detail
    return checks


@pytest.mark.slow
def test_one_graph_serves_every_batch_and_prompt_in_range(tmp_path: Path) -> None:
    """GQA with sliding windows (Mistral; MLA + MoE and an image prompt: the next test)."""
    spec, options = _dynamic("mistral", tmp_path, batch=2)
    _assert_serves_the_range(verify(spec, options, echo=lambda line: None), options)


MULTIMODAL = [
    "multimodal prefill logits",
    "multimodal greedy generation",
    "multimodal decode logits",
    "multimodal placeholder count checked before execution",
]


@pytest.mark.slow
def test_one_set_of_graphs_serves_text_and_image_prompts_in_range(tmp_path: Path) -> None:
    """MLA + MoE (stitched layers) with ``abi.vision.merged_prefill`` (Kimi-K2.5): the text graphs as
    above, and the saved vision -> multimodal prefill -> decode graphs against transformers given the
    pixels, at batch 2 (the image in row 0), then at batch 1 with a shorter prompt through the same
    files."""
    spec, options = _dynamic("kimi_k25", tmp_path, batch=2)
    lines: list[str] = []
    checks = _assert_serves_the_range(verify(spec, options, echo=lines.append), options)
    for name in MULTIMODAL:
        assert name in checks
    assert "(2, 264, 128)" in checks["multimodal prefill logits"].detail  # 8 text + 256 placeholders
    assert "positions 264..271" in checks["multimodal greedy generation"].detail
    assert "multimodal greedy generation (batch 1, prompt 258)" in checks
    assert "255 image placeholder tokens" in checks[MULTIMODAL[3]].detail
    assert any("image prompt 264, cache 272" in line for line in lines)


@pytest.mark.slow
def test_symbolic_ir_and_kv_mapping_name_the_sizes(tmp_path: Path) -> None:
    """The files say which dimension is which size and its range; nothing static is left symbolic."""
    spec, options = _dynamic("llama", tmp_path, batch=3)
    from kimi_adapter_core.backends.extraction import run
    from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
    from kimi_adapter_core.loading import applied, load_config, load_model

    config = load_config(spec, backend="extraction", overrides=tiny_overrides(spec, options))
    with applied(spec, backend="extraction"):
        run(spec, load_model(spec, device="meta", config=config), options, echo=lambda line: None)
    prefill = json.loads(options.path("prefill").read_text())
    decode = json.loads(options.path("decode").read_text())
    mapping = json.loads(options.path("kv_mapping").read_text())
    assert prefill["metadata"]["abi"]["dynamic"] == {"batch": [1, 3], "prefill_len": [1, options.prefill_len]}
    assert [i["shape"] for i in prefill["graph_inputs"]] == [
        ["batch", "prefill_len"],
        ["batch", 1, "prefill_len", "prefill_len"],
        ["batch", "prefill_len"],
    ]
    assert decode["graph_inputs"][3]["shape"] == ["batch"]  # cache_position: one position per row
    assert all(i["shape"][0] == "batch" for i in decode["graph_inputs"][:3] + decode["graph_inputs"][4:])
    assert all(isinstance(d, int) for w in prefill["weights"] for d in w["shape"])
    layer = mapping["layers"][0]
    assert layer["prefill_key_output"]["shape"][0] == "batch"
    assert layer["prefill_key_output"]["shape"][2] == "prefill_len"
    assert layer["decode_key_input"]["shape"][2] == options.max_cache_len
    assert mapping["contract"]["dynamic"]["sizes"] == {
        "batch": [1, 3],
        "prefill_len": [1, options.prefill_len],
    }
    assert mapping["prefill_to_decode"]["positions"] == [0, "prefill_len"]
    symbolic_attrs = [n for n in prefill["nodes"] if '"expr"' in json.dumps(n.get("attrs", {}))]
    assert symbolic_attrs, "a dynamic prefill graph computes its view sizes from the symbols"
    static = dataclasses.replace(options, dynamic=(), output_dir=tmp_path / "static")
    static.output_dir.mkdir()
    with applied(spec, backend="extraction"):
        run(spec, load_model(spec, device="meta", config=config), static, echo=lambda line: None)
    static_prefill = json.loads(static.path("prefill").read_text())
    assert "dynamic" not in static_prefill["metadata"]["abi"]
    assert '"expr"' not in static.path("prefill").read_text()
    shapes = [i["shape"] for i in static_prefill["graph_inputs"]]
    shapes += [o["shape"] for n in static_prefill["nodes"] for o in n["outputs"]]
    assert all(isinstance(d, int) for shape in shapes for d in shape)
