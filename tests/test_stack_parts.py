"""A spec names where the decoder stack keeps the parts the wrappers call (issue 37 item 1): its token
embedding, final norm and rotary embedding (``module_paths.embeddings`` / ``final_norm`` /
``rotary_embedding``, relative to ``module_paths.language_model``), so a stack whose parts have other
names (Mamba2: ``embeddings``, ``norm_f``) needs YAML only.

Proven on a tiny Mamba2 and a Llama whose rotary embedding is renamed: the wrappers ``apply`` exports,
the whole-model check and a generated module compute the model's own logits through the named parts; a
wrong path is refused at its spec key with the children the stack does have, by apply's check and by
``validate --resolve``; the family matrix's spec builder writes the keys for Mamba2 and none for Llama.
"""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from fixtures.modules import import_path
from transformers import AutoConfig, AutoModelForCausalLM

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction.ir.export import wrapper_for
from kimi_adapter_core.backends.extraction.ir.stack import Backbone, check_parts, probed_stack
from kimi_adapter_core.backends.extraction.job.whole_model import check_whole_model
from kimi_adapter_core.backends.extraction.options import bind_structure, options_from_spec
from kimi_adapter_core.backends.extraction.runtime import abi
from kimi_adapter_core.cli import cli
from kimi_adapter_core.errors import Refusal
from kimi_adapter_core.families.tiny import tiny_config
from kimi_adapter_core.families.trial import buildable_config, module_paths, write_spec
from kimi_adapter_core.generate import render_spec
from kimi_adapter_core.spec import Spec, load_spec
from kimi_adapter_core.spec.loader import check_spec
from kimi_adapter_core.spec.model import LAYERS, LAYERS_DEFAULT, STACK_PARTS, StackParts
from kimi_adapter_core.structure.derive import derive_structure

MAMBA2_PARTS = {"embeddings": "embeddings", "final_norm": "norm_f"}
PROMPT = 7


def mamba2_spec(folder: Path, **parts: str) -> Spec:
    """The family matrix's spec for a tiny Mamba2, with ``parts`` as its stack's module paths."""
    paths = {"language_model": "backbone", "lm_head": "lm_head", "language_layers": "backbone.layers"}
    return load_spec(write_spec(folder, "mamba2", tiny_config("mamba2"), {**paths, **parts}))


def tiny(model_type: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_config(model_type))).eval()


def prefill_logits(wrapper: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    _, mask, positions = abi.prefill_inputs(
        batch=1, prefill_len=ids.shape[1], dtype=torch.float32, device="cpu"
    )
    with torch.no_grad():
        return wrapper(ids, mask, positions)[0]


def prompt(vocab: int) -> torch.Tensor:
    return torch.randint(3, vocab, (1, PROMPT), generator=torch.Generator().manual_seed(1))


def test_the_runtime_and_the_spec_agree_on_the_usual_names() -> None:
    """abi.py is embedded in generated modules and cannot import kadapt: its copy must not drift (it
    holds the layer list's role too, which the spec reads from ``module_paths.language_layers``)."""
    assert abi.STACK_PARTS == {LAYERS: LAYERS_DEFAULT, **STACK_PARTS}


def test_the_matrix_spec_builder_names_a_mamba2_stacks_parts(tmp_path: Path) -> None:
    built = {t: buildable_config(t) for t in ("mamba2", "bamba", "llama")}
    assert not any(isinstance(found, str) for found in built.values())
    paths = {t: module_paths(found[1]) for t, found in built.items()}
    none = dict.fromkeys(("rotary_embedding", "position_embeddings", "embedding_norm"))
    assert {k: paths["mamba2"].get(k) for k in STACK_PARTS} == {**MAMBA2_PARTS, **none}
    assert {k: paths["bamba"].get(k) for k in STACK_PARTS} == {
        "embeddings": None,
        "final_norm": "final_layernorm",
        **none,
    }
    assert not set(paths["llama"]) & set(STACK_PARTS)  # the usual names: nothing written
    spec = load_spec(write_spec(tmp_path, "mamba2", built["mamba2"][0], paths["mamba2"]))
    assert dict(spec.stack_parts().stated) == MAMBA2_PARTS
    assert spec.stack_parts().path("rotary_embedding") == "rotary_emb"


def test_apply_and_the_whole_model_check_call_the_parts_a_spec_names(tmp_path: Path) -> None:
    """The prefill wrapper ``apply`` exports (``wrapper_for``) gives the Mamba2's own logits, and the
    whole-model check on the spec's tiny copy passes; the usual names do not exist in this stack."""
    spec = mamba2_spec(tmp_path, **MAMBA2_PARTS)
    model = tiny("mamba2")
    backbone = Backbone(model, model.backbone, model.lm_head, spec.stack_parts())
    check_parts(backbone)
    options = bind_structure(
        options_from_spec(spec, output_dir=tmp_path / "out"), derive_structure(model.config)
    )
    ids = prompt(model.config.vocab_size)
    with torch.no_grad():
        reference = model(ids).logits
    ours = prefill_logits(wrapper_for("prefill", backbone, options, num_layers=2), ids)
    assert (ours - reference).abs().max() <= 1e-5
    check_whole_model(spec, options)  # raises a Refusal when the wrappers differ from the model
    with pytest.raises(AttributeError, match="embed_tokens"):
        wrapper_for("prefill", Backbone(model, model.backbone, model.lm_head), options, num_layers=2)


@pytest.mark.parametrize(
    ("parts", "key", "missing", "where"),
    [
        (
            {"embeddings": "embeddings", "final_norm": "norm_x"},
            "final_norm",
            "norm_x",
            "module_paths.final_norm",
        ),
        ({}, "embeddings", "embed_tokens", "module_paths"),  # the usual name, by default
        ({**MAMBA2_PARTS, "rotary_embedding": "rope"}, "rotary_embedding", "rope", None),
    ],
    ids=["wrong-path", "default-name", "named-rotary"],
)
def test_a_missing_part_is_refused_at_its_key_with_the_stacks_children(
    tmp_path: Path, parts: dict[str, str], key: str, missing: str, where: str | None
) -> None:
    spec = mamba2_spec(tmp_path, **parts)
    found = buildable_config("mamba2")
    assert not isinstance(found, str)
    model = found[1]  # on meta
    with pytest.raises(Refusal) as refused:
        check_parts(Backbone(model, model.backbone, model.lm_head, spec.stack_parts()))
    assert refused.value.code == "stack-layout"
    message = refused.value.message
    assert f"Mamba2Model has no {missing} (module_paths.{key}" in message
    assert "its children: embeddings, layers, norm_f." in message
    assert f"set module_paths.{key} to where Mamba2Model keeps it" in message
    assert refused.value.location == spec.locate(where or f"module_paths.{key}")
    assert not refused.value.location.endswith(":1:1")  # a real spec line
    assert ("by default" in message) == (key not in parts)


def test_validate_resolve_points_at_the_missing_path(tmp_path: Path) -> None:
    spec = mamba2_spec(tmp_path, embeddings="embeddings", final_norm="norm_x")
    result = CliRunner().invoke(cli, ["validate", "--resolve", str(spec.path)])
    assert result.exit_code == 1, result.output
    assert f"{spec.locate('module_paths.final_norm')}: refused (stack-layout): Mamba2Model has no norm_x" in (
        result.output
    )
    assert "its children: embeddings, layers, norm_f" in result.output


def test_a_spec_names_a_renamed_rotary_embedding() -> None:
    """A Llama whose rotary embedding lives at ``rope``: named, the wrappers (and the layer probes) use
    it and give the model's logits; unnamed, the stack counts as one without rope (which a Llama layer
    cannot run: apply's whole-model check refuses that as ``stack-differs``)."""
    model = tiny("llama")
    ids = prompt(model.config.vocab_size)
    with torch.no_grad():
        reference = model(ids).logits
    stack = model.model
    stack.rope = stack.rotary_emb
    del stack.rotary_emb
    probed = probed_stack(stack, StackParts({"rotary_embedding": "rope"}))
    assert probed.rotary_emb is stack.rope and probed.layers is stack.layers
    wrapper: dict[str, Any] = {
        "kv_layout": "heads",
        "cache_keyword": upstream.decoder_protocol(probed).cache_keyword,
    }
    named = abi.PrefillWrapper.from_language_model(
        stack, model.lm_head, parts={"rotary_embedding": "rope"}, **wrapper
    )
    assert (prefill_logits(named, ids) - reference).abs().max() <= 1e-5
    unnamed = abi.PrefillWrapper.from_language_model(stack, model.lm_head, **wrapper)
    assert unnamed.rotary_emb is None  # a stack without rope, to the wrappers: Llama's layers need one
    with pytest.raises(TypeError, match="NoneType"):
        prefill_logits(unnamed, ids)


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, types.ModuleType]:
    folder = tmp_path_factory.mktemp("stack_parts_module")
    spec = mamba2_spec(folder, **MAMBA2_PARTS)
    files, _ = render_spec(spec, ["extraction"])
    text = {str(item.path): item.text for item in files}["adapters/mamba2/extraction.py"]
    (folder / "extraction.py").write_text(text)
    return text, import_path(folder / "extraction.py", "generated_mamba2_stack_parts")


def test_a_generated_module_calls_the_parts_its_spec_names(generated: tuple[str, types.ModuleType]) -> None:
    text, module = generated
    assert module.STACK_PART_PATHS == MAMBA2_PARTS
    assert text.count("parts=STACK_PART_PATHS,") == 3  # the prefill, decode and step wrappers
    assert "probed_stack(language_model, STACK_PART_PATHS)" in text  # the probes see the parts too
    torch.manual_seed(0)
    model = module.build_model(device="cpu", dtype=None)
    ids = prompt(model.config.vocab_size)
    with torch.no_grad():
        reference = model(ids).logits
    assert (prefill_logits(module.prefill_wrapper(model), ids) - reference).abs().max() <= 1e-5


def test_a_path_that_is_not_a_module_path_is_invalid(tmp_path: Path) -> None:
    spec = mamba2_spec(tmp_path, final_norm="norm_f")
    spec.path.write_text(spec.path.read_text().replace('"final_norm": "norm_f"', '"final_norm": "norm f"'))
    found = check_spec(spec.path).diagnostics
    assert [d.message for d in found if "module_paths/final_norm" in d.message or "norm f" in d.message]
