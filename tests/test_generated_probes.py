"""What a generated extraction module probes, and under which patches.

- The contact points it checks at import are the ones kadapt's own run checks of the same stack
  (``job.contact_points.stack_points``: one list for both), read from the committed file.
- Its wrappers probe the model's layers with the spec's patches installed, also when the caller builds
  them outside ``patches_applied()`` and no earlier probe is cached; a probe made under the patches
  never answers for the layers without them.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from fixtures.modules import import_path
from fixtures.releases import not_here
from transformers.models.llama4 import modeling_llama4

from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.job.contact_points import stack_points
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.generate.common import NotExpressible
from kimi_adapter_core.generate.extraction import render_extraction
from kimi_adapter_core.loading import load_config
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.of_spec import structure_of_config

REPO = Path(__file__).resolve().parents[1]
GENERATED = sorted(p.parent.name for p in (REPO / "adapters").glob("*/extraction.py"))
SCOUT = REPO / "specs" / "llama4_scout.yaml"


def checked_at_import(path: Path) -> tuple[str, ...]:
    """The literal tuple of the module's top-level ``check(...)`` call (the points it checks at import)."""
    calls = [
        node.value
        for node in ast.parse(path.read_text(encoding="utf-8")).body
        if isinstance(node, ast.Expr)
        and isinstance(node.value, ast.Call)
        and getattr(node.value.func, "id", None) == "check"
    ]
    assert len(calls) == 1, f"{path}: {len(calls)} top-level check() calls"
    return ast.literal_eval(calls[0].args[0])


# shipped specs whose extraction module kadapt generate skips, and the located reason it gives (none
# today: DeepSeek-V4's compressed layers are carried since issue 36)
NOT_GENERATED: dict[str, str] = {}


def test_every_shipped_spec_with_an_abi_has_a_generated_module() -> None:
    """Or generate refuses it, located, saying why (never a silently missing module)."""
    with_abi = sorted(p.stem for p in (REPO / "specs").glob("*.yaml") if load_spec(p).abi is not None)
    skipped = {"kimi_k25_remote", *NOT_GENERATED}
    assert GENERATED == [name for name in with_abi if name not in skipped]
    for name, reason in NOT_GENERATED.items():
        with pytest.raises(NotExpressible, match=reason) as refused:
            render_extraction(load_spec(REPO / "specs" / f"{name}.yaml"))
        assert f"specs/{name}.yaml:" in str(refused.value)


@pytest.mark.parametrize("name", GENERATED)
def test_the_module_checks_the_stack_points_of_its_structure(name: str) -> None:
    spec = load_spec(REPO / "specs" / f"{name}.yaml")
    structure = structure_of_config(spec, load_config(spec, backend="extraction"))
    checked = checked_at_import(REPO / "adapters" / name / "extraction.py")
    assert checked == stack_points(structure)  # kadapt's run checks these besides its own (RUN_POINTS)


@pytest.mark.skipif(not_here(SCOUT) is not None, reason=str(not_here(SCOUT)))  # its builtins' pins
def test_wrappers_probe_the_layers_under_the_patches(tmp_path: Path) -> None:
    """Llama-4's rotary embedding returns (cos, sin) only under Scout's builtin: built outside
    ``patches_applied()`` with no earlier probe cached, the wrappers still probe the patched layers;
    inside the caller's block its patches are back once the wrapper is built; the patches are gone after
    either; and their probe does not answer without them."""
    spec = load_spec(SCOUT)
    module = import_path(REPO / "adapters" / "llama4_scout" / "extraction.py", "generated_probes_llama4")
    tiny = tiny_overrides(spec, options_from_spec(spec, output_dir=tmp_path))
    rotary = modeling_llama4.Llama4TextRotaryEmbedding
    original = vars(rotary)["forward"]
    model = module.build_model(device="cpu", overrides=tiny, dtype=None)
    language_model = model.get_submodule(module.LANGUAGE_MODEL_PATH)
    module.forget()
    prefill = module.prefill_wrapper(model)
    assert vars(rotary)["forward"] is original
    with torch.no_grad(), module.patches_applied():
        patched = vars(rotary)["forward"]
        decode = module.decode_wrapper(model)
        assert vars(rotary)["forward"] is patched
        ids = torch.randint(4, 64, (1, module.PREFILL_LEN), generator=torch.Generator().manual_seed(0))
        _, mask, positions = module.prefill_inputs(
            batch=1, prefill_len=module.PREFILL_LEN, dtype=torch.float32, device="cpu"
        )
        logits = prefill(ids, mask, positions)[0]
    assert vars(rotary)["forward"] is original
    assert prefill.cache_keyword == decode.cache_keyword
    assert logits.shape[:2] == (1, module.PREFILL_LEN) and torch.isfinite(logits).all()
    with pytest.raises(module.LayersUnsupported, match="Llama4TextRotaryEmbedding returns Tensor"):
        module.decoder_protocol(language_model)


def test_the_layer_probe_cache_keeps_the_newest_results_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every patch session installs new dispatchers, so its layers probe under new keys: the cache keeps
    the newest ``MAX_PROTOCOLS`` results, oldest dropped first, instead of every session's layers."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kimi_adapter_core import upstream

    upstream.forget()
    monkeypatch.setattr(upstream, "MAX_PROTOCOLS", 2)
    models = []
    for width in (32, 48, 64):  # other parameter shapes: other keys
        config = LlamaConfig(
            hidden_size=width, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, vocab_size=32,
        )  # fmt: skip
        with torch.device("meta"):
            models.append(LlamaForCausalLM(config))
        upstream.decoder_protocol(models[-1].model)
    kept = [key for key in upstream._protocols]
    assert len(kept) == 2
    # a key: (kind, residual streams, where the layer keeps its attention, the layer's key parts...),
    # each part's third item its parameters
    widths = {shape[1] for key in kept for part in key[4:] for shape, _ in part[2] if len(shape) == 2}
    assert 32 not in widths and {48, 64} <= widths  # the first model's result went first
    upstream.forget()
