"""A failed ``--verify`` leaves nothing that looks verified, and says where the replay first departs.

``kadapt apply --verify`` writes (or restores) the run's files into a hidden folder inside the output
folder and renames them into place only once verify passed (``job.held.Held``): a failed verify, or an
error during it, leaves the folder exactly as it was, whether the files were extracted or restored
from the extraction cache. The verify report names the first layer and output (key or value cache) of
the saved graphs that departs from transformers', found only after a logits or token check failed.

The localisation is shown on one verify of the tiny Llama whose layer 1 key projection is damaged in
the weights the replay binds (the technique of tests/test_verify_mutations.py, on the weights): the
reference is untouched, so the saved files must depart at layer 1's key cache. The other defects are
given to the same replay directly. The CLI tests replace verify by a report (the contract under test
is what apply does with it), sharing one extraction through the cache.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import pytest
import torch
from click.testing import CliRunner

from kimi_adapter_core.backends.extraction import options_from_spec, verify
from kimi_adapter_core.backends.extraction.equivalence import comparisons, departure, roundtrip
from kimi_adapter_core.backends.extraction.equivalence.verdict import VerifyReport
from kimi_adapter_core.backends.extraction.job.held import HELD_PREFIX, held_until_verified
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
LLAMA = REPO / "specs" / "llama.yaml"
LAYER_1_KEY = "model.layers.1.self_attn.k_proj.weight"
DECODE_STEPS = 6


def damaged(weights: dict[str, torch.Tensor], name: str) -> dict[str, torch.Tensor]:
    """``weights`` with tensor ``name`` moved well outside any tolerance."""
    noise = torch.randn(weights[name].shape, generator=torch.Generator().manual_seed(3))
    return {**weights, name: weights[name] + 0.5 * noise.to(weights[name].dtype)}


class Caught(NamedTuple):
    """The failed verify, and what its first text comparison ran with (to replay other defects)."""

    report: VerifyReport
    model: torch.nn.Module
    replay: Any
    prompt: torch.Tensor
    tolerance: Any
    clean: dict[str, torch.Tensor]

    def replay_with(self, weights: dict[str, torch.Tensor]) -> Any:
        replay = copy.copy(self.replay)
        replay.weights = weights
        return replay

    def localise(self, replay: Any) -> str:
        return departure.localise(self.model, replay, self.prompt, DECODE_STEPS, self.tolerance)


@pytest.fixture(scope="module")
def caught(tmp_path_factory: pytest.TempPathFactory) -> Caught:
    spec = load_spec(LLAMA)
    options = options_from_spec(spec, output_dir=tmp_path_factory.mktemp("verify") / "out")
    options = dataclasses.replace(options, verify_dtypes=("float32",), verify_decode_steps=DECODE_STEPS)
    seen: dict[str, Any] = {}
    real_load, real_compare = roundtrip.saved_and_loaded, roundtrip.compare_prompt

    def load(model: Any, small: Any, tmp: Path) -> dict[str, torch.Tensor]:
        seen["clean"] = real_load(model, small, tmp)
        return damaged(seen["clean"], LAYER_1_KEY)

    def compare(report: Any, model: Any, replay: Any, prompt: Any, steps: int, **kwargs: Any) -> None:
        seen.setdefault("run", (model, replay, prompt, kwargs["tolerance"]))
        real_compare(report, model, replay, prompt, steps, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(roundtrip, "saved_and_loaded", load)
        patch.setattr(roundtrip, "compare_prompt", compare)
        report = verify(spec, options, echo=lambda line: None)
    return Caught(report, *seen["run"], seen["clean"])


def test_the_report_names_the_first_departing_layer_and_output(caught: Caught) -> None:
    report = caught.report
    assert not report.passed and "prefill logits" in {c.name for c in report.checks if not c.passed}
    assert report.first_departure is not None
    assert report.first_departure.startswith(
        "prefill: layer 1 key cache departs first (output 'present.1.key': max |diff|"
    ), report.first_departure
    # position 0 attends to itself only: a wrong key cannot change it, position 1 is the first it can
    assert "its value is within the bound" in report.first_departure
    assert "logits differ from position 1 (float32, prompt (1, 8))" in report.first_departure
    assert f"  first departure: {report.first_departure}" in report.render()
    assert report.to_dict()["first_departure"] == report.first_departure


def test_a_passing_comparison_never_localises(caught: Caught, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any) -> str:
        raise AssertionError("localised on the passing path")

    monkeypatch.setattr(comparisons, "localise", refuse)
    report = VerifyReport("heads", caught.tolerance.limit)
    replay = caught.replay_with(caught.clean)
    comparisons.compare_prompt(
        report, caught.model, replay, caught.prompt, DECODE_STEPS, tolerance=caught.tolerance
    )
    assert report.passed, report.render()
    assert report.first_departure is None and "first_departure" not in report.to_dict()


def test_the_same_files_on_good_weights_have_no_departure(caught: Caught) -> None:
    assert caught.localise(caught.replay_with(caught.clean)).startswith(
        "not localised: fed the same tokens, every layer's KV cache and the logits stay within the bound"
    )


def test_a_wrong_layer_output_shows_in_the_next_layers_key_and_value(caught: Caught) -> None:
    wrong = damaged(caught.clean, "model.layers.0.self_attn.o_proj.weight")
    found = caught.localise(caught.replay_with(wrong))
    assert found.startswith("prefill: layer 1 key cache departs first (output 'present.1.key'"), found
    assert "key and value both: layer 1's input (layer 0's attention or MLP)" in found


def test_a_wrong_final_norm_departs_after_the_last_cache_write(caught: Caught) -> None:
    found = caught.localise(caught.replay_with(damaged(caught.clean, "model.norm.weight")))
    assert found.startswith(
        "prefill: every layer's KV cache is within the bound, logits differ from position 0: the departure "
        "is after the last cache write"
    ), found


def test_a_decode_only_defect_is_placed_in_its_step(caught: Caught) -> None:
    """A decode graph whose layer 1 value cache comes out wrong (its prefill and logits right)."""
    replay = caught.replay_with(caught.clean)
    real_execute = replay.execute
    value_1 = 1 + 2 * 1 + 1  # logits, then key and value of each layer

    def execute(kind: str, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
        outputs = real_execute(kind, inputs)
        if kind == "decode":
            outputs[value_1] = outputs[value_1] + 1.0
        return outputs

    replay.execute = execute
    found = caught.localise(replay)
    output = replay.output_name("decode", value_1)
    assert found.startswith(f"decode step 1: layer 1 value cache departs first (output {output!r}"), found
    assert found.endswith("; logits within the bound")


def test_the_held_folder_goes_on_any_exception(tmp_path: Path) -> None:
    with pytest.raises(KeyboardInterrupt), held_until_verified(tmp_path) as held:
        (held.folder / "llama_prefill_ir.json").write_text("{}")
        raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


# --- kadapt apply --verify: what is in the output folder afterwards -----------------------------------


def fake_verify(outcome: bool | Exception) -> Callable[..., VerifyReport]:
    """A verify whose report passes or fails (naming a departure), or that raises ``outcome``."""

    def run(spec: Any, options: Any, **kwargs: Any) -> VerifyReport:
        if isinstance(outcome, Exception):
            raise outcome
        report = VerifyReport("heads", 1e-4)
        report.add("prefill logits", outcome, "replaced by the test")
        if not outcome:
            report.first_departure = "prefill: layer 1 key cache departs first (replaced by the test)"
        return report

    return run


def folder(path: Path) -> dict[str, bytes]:
    """Every entry of ``path`` (hidden ones too) and its bytes."""
    return {p.name: p.read_bytes() if p.is_file() else b"<dir>" for p in sorted(path.iterdir())}


def earlier_run(out: Path) -> dict[str, bytes]:
    """An output folder with a file of an earlier run and one of the user's; its contents."""
    out.mkdir(parents=True)
    (out / "llama_prefill_ir.json").write_text('{"from": "an earlier run"}\n')
    (out / "notes.txt").write_text("mine\n")
    return folder(out)


def apply_verified(out: Path, outcome: bool | Exception, cache: Path, *extra: str) -> Any:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KADAPT_CACHE_DIR", str(cache))
        patch.setattr(roundtrip, "verify", fake_verify(outcome))
        args = ["apply", str(LLAMA), "--output-dir", str(out), "--verify", "--format", "json", *extra]
        return CliRunner().invoke(cli, args)


class Failed(NamedTuple):
    result: Any
    out: Path
    before: dict[str, bytes]
    cache: Path


@pytest.fixture(scope="module")
def extracted_then_failed(tmp_path_factory: pytest.TempPathFactory) -> Failed:
    """The one extraction of these tests: a first run (empty cache) whose verify fails."""
    root = tmp_path_factory.mktemp("apply")
    out, cache = root / "out", root / "cache"
    before = earlier_run(out)
    return Failed(apply_verified(out, False, cache), out, before, cache)


def assert_failed_and_untouched(result: Any, out: Path, before: dict[str, bytes]) -> dict[str, Any]:
    assert result.exit_code == 1, result.output
    assert (
        "error: verification failed: the saved IR does not match transformers; first departure: "
        "prefill: layer 1 key cache departs first (replaced by the test)" in result.stderr
    )
    assert f"Nothing was written to {out}: the unverified files were removed" in result.stderr
    assert folder(out) == before  # same names, same bytes, no hidden folder left behind
    data = json.loads(result.stdout)
    assert data["verify"]["passed"] is False and data["extraction"]["written"] is False
    assert data["extraction"]["graphs"]["prefill"]["path"] == str(out / "llama_prefill_ir.json")
    return data


def test_an_extracted_run_that_fails_verify_leaves_the_folder_as_it_was(
    extracted_then_failed: Failed,
) -> None:
    result, out, before, _ = extracted_then_failed
    data = assert_failed_and_untouched(result, out, before)
    # the cache keeps the extraction (same inputs, same bytes) but no verdict: verify runs every time
    assert data["extraction"]["cache"]["stored"] is True


def test_a_restored_run_that_fails_verify_leaves_the_folder_as_it_was(
    extracted_then_failed: Failed, tmp_path: Path
) -> None:
    before = earlier_run(tmp_path / "out")
    result = apply_verified(tmp_path / "out", False, extracted_then_failed.cache)
    data = assert_failed_and_untouched(result, tmp_path / "out", before)
    assert data["extraction"]["cache"]["hit"] is True


def test_an_error_inside_verify_leaves_the_folder_as_it_was(
    extracted_then_failed: Failed, tmp_path: Path
) -> None:
    before = earlier_run(tmp_path / "out")
    result = apply_verified(tmp_path / "out", KadaptError("verify broke"), extracted_then_failed.cache)
    assert result.exit_code == 1 and "error: verify broke" in result.stderr
    assert folder(tmp_path / "out") == before


def test_a_passing_verify_puts_the_files_in_place_as_apply_writes_them(
    extracted_then_failed: Failed, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    earlier_run(tmp_path / "verified")
    result = apply_verified(tmp_path / "verified", True, extracted_then_failed.cache)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["verify"]["passed"] is True and "written" not in data["extraction"]
    monkeypatch.setenv("KADAPT_CACHE_DIR", str(extracted_then_failed.cache))
    plain = CliRunner().invoke(cli, ["apply", str(LLAMA), "--output-dir", str(tmp_path / "plain"), "-q"])
    assert plain.exit_code == 0, plain.output
    written = folder(tmp_path / "verified")
    assert written.pop("notes.txt") == b"mine\n"  # the user's file stays; the earlier run's is replaced
    assert written == folder(tmp_path / "plain")
    assert not any(name.startswith(HELD_PREFIX) for name in written)
    assert data["extraction"]["kv_mapping"]["path"] == str(tmp_path / "verified" / "llama_kv_mapping.json")
