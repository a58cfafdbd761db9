"""verify(): saved IR files, replayed by torch_ir, generate what transformers generates — both KV layouts,
and the absorbed MLA attention over the latent cache."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
from fixtures.shared_apply import SharedApplies
from fixtures.spec_files import KIMI_SPEC as SPEC

from kimi_adapter_core.backends.extraction import ExtractionOptions, options_from_spec, verify
from kimi_adapter_core.backends.extraction.equivalence.verdict import Check, VerifyReport
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.spec import load_spec


def _assert_generates_what_transformers_generates(
    report: dict[str, Any], options: ExtractionOptions, kv_layout: str, mla_attention: str
) -> None:
    """What ``VerifyReport.to_dict()`` (``kadapt apply --verify --format json``'s "verify") must say."""
    assert report["passed"], [check for check in report["checks"] if not check["passed"]]
    fp32 = ["weights bind to checkpoint names", "prefill logits", "greedy generation", "decode logits"]
    bf16 = [f"{name} (bfloat16)" for name in fp32[1:]]
    vision = ["vision weights bind", "vision features"]  # the spec's abi.vision graph, in each dtype
    # abi.vision.merged_prefill: an image prompt through the saved vision, merged and decode JSON
    multimodal = [
        "multimodal prefill logits",
        "multimodal greedy generation",
        "multimodal decode logits",
        "multimodal placeholder count checked before execution",
    ]
    fp32, bf16 = fp32 + vision + multimodal, bf16 + [f"{n} (bfloat16)" for n in vision + multimodal]
    # absorbed MLA rounds in another order than transformers' attention: bf16 is noted, not compared
    assert [c["name"] for c in report["checks"]] == (fp32 if mla_attention == "absorbed" else fp32 + bf16)
    assert bool(report["notes"]) == (mla_attention == "absorbed")
    # 1 token from prefill + 24 decode steps through the one decode graph, positions 8..31
    assert len(report["tokens_ir"][0]) == 25 and report["tokens_ir"] == report["tokens_reference"]
    assert len(set(report["tokens_ir"][0])) > 5  # a real sequence, not one repeated token
    assert report["max_logit_diff"] <= options.verify_tolerance
    assert report["kv_layout"] == kv_layout and report["mla_attention"] == mla_attention


def test_apply_verify_at_the_spec_defaults_matches_transformers_generate(
    shipped_apply: SharedApplies,
) -> None:
    """The spec's defaults (latent KV, re-expanding MLA) are what ``kadapt apply specs/kimi_k25.yaml
    --verify`` checks: its report, read from the shared run (``shipped_apply``)."""
    options = options_from_spec(SPEC)
    assert (options.kv_layout, options.mla_attention) == ("latent", "reexpand")
    assert options.verify_decode_steps >= 20
    result = shipped_apply("kimi_k25")
    assert result.exit_code == 0, result.output
    _assert_generates_what_transformers_generates(result.data()["verify"], options, "latent", "reexpand")


@pytest.mark.parametrize(("kv_layout", "mla_attention"), [("expanded", "reexpand"), ("latent", "absorbed")])
def test_verify_matches_transformers_generate(tmp_path: Path, kv_layout: str, mla_attention: str) -> None:
    """The other layout and the other attention (the spec's defaults: the test above), and what only a
    run in this process sees: the rendered report, the echoed lines, an untouched output folder."""
    options = options_from_spec(SPEC, output_dir=tmp_path, kv_layout=kv_layout, mla_attention=mla_attention)
    assert options.verify_decode_steps >= 20
    lines: list[str] = []
    report = verify(SPEC, options, echo=lines.append)
    assert report.passed, report.render()
    _assert_generates_what_transformers_generates(report.to_dict(), options, kv_layout, mla_attention)
    assert "PASSED" in report.render() and f"{kv_layout} KV, {mla_attention} MLA" in report.render()
    assert any("replicate decode" in line for line in lines)  # the stitched path was exercised
    assert list(tmp_path.iterdir()) == []  # the check writes to a temp dir, not the output dir


LONG_STEPS = 200


@pytest.mark.slow
def test_bf16_verify_holds_over_200_greedy_steps(tmp_path: Path) -> None:
    """Issue 22's case: Mistral decoding 200 greedy steps in bf16, logits of magnitude near 8 where one
    bf16 step is 0.03-0.06. The bound is in ulps (the one ``tolerance.compare``), stated in the report."""
    spec = load_spec("mistral")
    options = options_from_spec(spec, output_dir=tmp_path)
    options = dataclasses.replace(
        options,
        verify_decode_steps=LONG_STEPS,
        verify_max_cache_len=options.verify_prefill_len + LONG_STEPS + 8,
    )
    report = verify(spec, options, echo=lambda _: None)
    assert report.passed, report.render()
    checks = {check.name: check for check in report.checks}
    bound = f"bound {options.verify_tolerance_ulps:g} ulps of bfloat16"
    for name in ("prefill logits (bfloat16)", "decode logits (bfloat16)"):
        assert bound in checks[name].detail and " ulps; " in checks[name].detail
    assert f"over {LONG_STEPS + 1} tokens" in checks["decode logits (bfloat16)"].detail
    assert f"{LONG_STEPS + 1} tokens" in checks["greedy generation (bfloat16)"].detail
    assert len(report.tokens_ir[0]) == LONG_STEPS + 1 and report.tokens_ir == report.tokens_reference
    assert report.to_dict()["tolerance_ulps"] == options.verify_tolerance_ulps
    assert f"{options.verify_tolerance_ulps:g} ulps in low precision" in report.render()


def test_tiny_overrides_shrink_every_sub_model(tmp_path: Path) -> None:
    overrides = tiny_overrides(SPEC, options_from_spec(SPEC, output_dir=tmp_path))
    assert overrides["text_config.hidden_size"] == 64 and overrides["text_config.n_routed_experts"] == 8
    assert overrides["text_config.first_k_dense_replace"] == 1 and overrides["text_config.vocab_size"] == 128
    assert (
        overrides["vision_config.vt_hidden_size"] == 32
        and overrides["vision_config.vt_num_hidden_layers"] == 3  # stitched: 2 traced, 1 copied
    )
    assert overrides["text_config.pad_token_id"] == 0 and overrides["pad_token_id"] == 0
    assert "text_config.num_local_experts" not in overrides  # only keys the config has


def test_report_fails_on_any_failed_check() -> None:
    report = VerifyReport("latent", 1e-4)
    assert not report.passed  # no checks run: nothing verified
    report.checks = [Check("prefill logits", True, "ok"), Check("greedy generation", False, "differ")]
    assert not report.passed and "FAILED" in report.render() and "[FAIL] greedy generation" in report.render()
