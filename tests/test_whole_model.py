"""Before exporting, the wrappers are checked against the model's own forward on a tiny random model:
math a family does outside its decoder layers is refused (``outside-layers``), located at the
embeddings or at the head, whether or not any config key announces it."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from fixtures.spec_files import SMALL_FAMILY, write_family_spec

from kimi_adapter_core.cli import cli

PATCHES = {
    "embeddings": (
        "transformers.models.llama.modeling_llama:LlamaModel.forward",
        "fixtures.outside_math:scale_embeddings",
        "at the embeddings: LlamaForCausalLM's forward hands the first decoder layer "
        "embed_tokens(input_ids) x3",
    ),
    "head": (
        "transformers.models.llama.modeling_llama:LlamaForCausalLM.forward",
        "fixtures.outside_math:scale_logits",
        "at the head: LlamaForCausalLM's logits are lm_head(norm(hidden)) x0.5",
    ),
}


def _outside_math_spec(tmp_path: Path, side: str) -> Path:
    """Llama with math outside its decoder layers at ``side``, made by a spec patch."""
    target, impl, _ = PATCHES[side]
    spec = write_family_spec(tmp_path, "llama", SMALL_FAMILY)
    spec.write_text(
        spec.read_text()
        + f"""
patches:
  - id: O1
    why: math outside the decoder layers
    target: {target}
    kind: wrap
    impl: {impl}
    backends: [extraction]
"""
    )
    return spec


@pytest.mark.parametrize("side", sorted(PATCHES))
def test_math_outside_the_layers_is_refused_before_export(side: str, tmp_path: Path) -> None:
    """A family kadapt has never seen that scales its embeddings in the model's forward, or its logits in
    the head's, with no config key saying so (made here from Llama by a spec patch): refused, located."""
    where = PATCHES[side][2]
    spec = _outside_math_spec(tmp_path, side)
    out = tmp_path / "out"
    result = CliRunner().invoke(cli, ["apply", str(spec), "--output-dir", str(out)])
    assert result.exit_code == 1, result.output
    assert "refused (outside-layers):" in result.output and where in result.output, result.output
    assert "Traceback" not in result.output and not any(out.iterdir())  # nothing exported


@pytest.mark.parametrize("model_type", ["cohere", "gemma2"])
def test_modelled_math_outside_the_layers_exports_and_verifies(model_type: str, tmp_path: Path) -> None:
    """Cohere's logit scale (exported without it before, exit 0) and Gemma-2's final soft-capping are
    applied by the wrappers: the whole-model check passes and --verify proves the saved graphs."""
    spec = write_family_spec(tmp_path, model_type, SMALL_FAMILY)
    result = CliRunner().invoke(cli, ["apply", str(spec), "--output-dir", str(tmp_path / "out"), "--verify"])
    assert result.exit_code == 0, result.output
    assert {"cohere": "logits x 0.0625 (logit_scale)", "gemma2": "soft-capped at 30"}[
        model_type
    ] in result.output
    assert "PASSED" in result.output


def test_a_scaled_embedding_module_is_the_model_and_exports(tmp_path: Path) -> None:
    """Gemma scales its embeddings inside its embedding module (embed_scale, a computed buffer that has
    no value on meta: transformers' own _init_weights gives it one): adapted, and --verify proves it."""
    spec = write_family_spec(tmp_path, "gemma", SMALL_FAMILY)
    result = CliRunner().invoke(cli, ["apply", str(spec), "--output-dir", str(tmp_path / "out"), "--verify"])
    assert result.exit_code == 0, result.output
    assert "PASSED" in result.output


def test_verify_kept_in_a_folder_is_an_apply_of_the_tiny_model(tmp_path: Path) -> None:
    """``verify(..., keep_in=folder)``, the family trial's one extraction, checks what ``apply`` checks
    before exporting: the outside-math model is refused with nothing written (verify alone does not
    run that check), and a plain model's graphs stay in the folder at verify's sizes."""
    from kimi_adapter_core.backends import extraction
    from kimi_adapter_core.errors import Refusal
    from kimi_adapter_core.spec import load_spec

    def verify_into(spec_path: Path, out: Path) -> extraction.VerifyReport:
        spec = load_spec(spec_path)
        options = dataclasses.replace(
            extraction.options_from_spec(spec, output_dir=out), verify_dtypes=("float32",)
        )
        return extraction.verify(spec, options, echo=lambda line: None, keep_in=out)

    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    refused = tmp_path / "refused"
    with pytest.raises(Refusal, match="outside-layers"):
        verify_into(_outside_math_spec(tmp_path / "a", "head"), refused)
    assert not refused.exists() or not any(refused.iterdir())

    kept = tmp_path / "kept"
    report = verify_into(write_family_spec(tmp_path / "b", "llama", SMALL_FAMILY), kept)
    assert report.passed, report.render()
    mapping = json.loads((kept / "llama_kv_mapping.json").read_text())
    assert mapping["layers"][0]["decode_key_input"]["shape"][2] == 40  # verify's cache, not the spec's
    assert {p.suffix for p in kept.iterdir()} >= {".json"} and len(list(kept.iterdir())) >= 4
