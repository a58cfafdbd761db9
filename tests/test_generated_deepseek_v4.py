"""DeepSeek-V4's generated extraction module (issue 36): its compressed layers and ``wrap`` patches.

``adapters/deepseek_v4_flash/extraction.py`` is imported by path, without kadapt. The spec's three
compressor builtins are ``wrap`` patches: the module builds their behaviour with kadapt's own builder of
the kind (embedded), installs them for its block only and restores the originals, and a model it did
not build runs transformers' compressors untouched. On a tiny random DeepSeek-V4 ``[sliding, sliding,
csa, hca]`` (rates 4) whose csa indexer keeps the top 2 entries, the module's wrappers equal kadapt's
runtime wrappers bit for bit (logits and every KV window, ring and entry) and transformers' eager
forward within ``--verify``'s tolerance, over a decode that closes three more windows, so past the
second closed window the indexer's top-k decides which entries a query attends over.

The spec's pins list transformers 5.23's and 5.24's sources: the module patches either release's
compressors (``compat``: its wrappers are checked on both).
"""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest
import torch
from fixtures.modules import import_path
from fixtures.releases import not_here

from kimi_adapter_core import upstream
from kimi_adapter_core.backends.extraction import options_from_spec
from kimi_adapter_core.backends.extraction.names import state_roles
from kimi_adapter_core.backends.extraction.runtime import abi as runtime
from kimi_adapter_core.backends.extraction.tiny_model import tiny_overrides
from kimi_adapter_core.loading import applied, load_config, load_model, submodule
from kimi_adapter_core.patching import portable
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.structure.derive import derive_structure

REPO = Path(__file__).resolve().parents[1]
SPEC_PATH = REPO / "specs" / "deepseek_v4_flash.yaml"
pytestmark = pytest.mark.skipif(not_here(SPEC_PATH) is not None, reason=str(not_here(SPEC_PATH)))
PREFILL, CACHE, STEPS = 8, 32, 12  # decode closes the windows at positions 11, 15 and 19
TOP_K = 2  # fewer than the closed entries from position 11 on: the indexer picks
TOLERANCE = 1e-4  # --verify's default for logits against transformers


@pytest.fixture(scope="module")
def module():  # noqa: ANN201 - the generated module
    return import_path(REPO / "adapters" / "deepseek_v4_flash" / "extraction.py", "generated_deepseek_v4")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict:
    spec = load_spec(SPEC_PATH)
    options = options_from_spec(
        spec, output_dir=tmp_path_factory.mktemp("unused"), prefill_len=PREFILL, max_cache_len=CACHE
    )
    return {**tiny_overrides(spec, options), "index_topk": TOP_K}


def test_the_readers_take_a_legacy_config_like_kadapt(module) -> None:  # noqa: ANN001
    """A published config.json lists a compress ratio per layer instead of layer_types and compress_rates:
    the module reads the kinds and rates from it as kadapt's structure does (as transformers does)."""
    legacy = {k: v for k, v in module.SOURCE_CONFIG.items() if k not in ("layer_types", "compress_rates")}
    ratios = {"attention": 0, **{kind: rate for kind, rate in module.COMPRESS_RATES.items()}}
    legacy["compress_ratios"] = [ratios[kind] for kind in module.LAYER_KINDS]
    found = derive_structure(legacy, load_spec(SPEC_PATH))
    assert module.layer_kinds(legacy) == found.layer_kinds == module.LAYER_KINDS
    assert module.compress_rates(legacy) == {k: c.rate for k, c in found.compressors.items()}
    assert module.windows(legacy) == found.windows
    with pytest.raises(ValueError, match="compress_ratios"):
        module.layer_kinds({**legacy, "compress_ratios": [0, 8]})


def test_wraps_are_built_by_kadapts_builder_gated_and_restored(module, tiny: dict) -> None:  # noqa: ANN001
    assert {kind for _, kind, *_ in module.PATCHES} == {"wrap"}
    assert inspect.getsource(module.PATCH_KINDS["wrap"]) == inspect.getsource(portable.build_wrap)
    ours = module.build_model(device="cpu", overrides=tiny, dtype=None)
    with applied(load_spec(SPEC_PATH), backend="extraction"):  # kadapt's own session: claimed models only
        config = load_config(load_spec(SPEC_PATH), backend="extraction", overrides=tiny)
    theirs = type(ours)(config).eval()  # built by transformers alone: not claimed
    originals = {}
    for patch_id, _kind, owner_module, owner_path, attr, _impl, _options, _pin in module.PATCHES:
        owner = getattr(__import__(owner_module, fromlist=["_"]), owner_path)
        originals[patch_id] = (owner, attr, vars(owner)[attr])
    ids = torch.randint(4, 64, (1, PREFILL), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        unpatched = theirs(input_ids=ids, use_cache=True).logits
    with module.patches_applied():
        for owner, attr, original in originals.values():
            assert vars(owner)[attr] is not original and vars(owner)[attr].__wrapped__ is original
        compressor = ours.model.layers[3].self_attn.compressor
        assert module._owns_call((compressor,))
        assert not module._owns_call((theirs.model.layers[3].self_attn.compressor,))
        with torch.no_grad():  # not the module's model: transformers' compressors, untouched
            assert torch.equal(theirs(input_ids=ids, use_cache=True).logits, unpatched)
    for owner, attr, original in originals.values():
        assert vars(owner)[attr] is original


@pytest.mark.compat
def test_wrappers_equal_kadapts_runtime_and_transformers_past_the_top_k(module, tiny: dict) -> None:  # noqa: ANN001
    spec = load_spec(SPEC_PATH)
    torch.manual_seed(0)
    with applied(spec, backend="extraction"):
        config = load_config(spec, backend="extraction", overrides=tiny)
        reference = load_model(spec, device="cpu", config=config, dtype=torch.float32).eval()
    ours = module.build_model(device="cpu", overrides=tiny, dtype=None)
    ours.load_state_dict(reference.state_dict())
    text = module.text_config(ours.config)
    kinds = module.layer_kinds(text)
    assert kinds == ("attention", "attention", "csa", "hca")
    assert (
        module.compress_rates(text) == {"csa": 4, "hca": 4}
        and module.index_dim(text) == tiny["index_head_dim"]
    )

    def kadapts(cls: type) -> torch.nn.Module:
        language_model = submodule(reference, spec, "language_model")
        return cls.from_language_model(
            language_model,
            submodule(reference, spec, "lm_head"),
            kv_layout=module.KV_LAYOUT,
            cache_keyword=upstream.decoder_protocol(language_model, kinds).cache_keyword,
            windows=module.windows(text),
            rope_layer_types=upstream.rope_layer_types(language_model),
            layer_kinds=kinds,
        )

    ids = torch.randint(4, text.vocab_size, (1, PREFILL), generator=torch.Generator().manual_seed(2))
    _, mask, positions = module.prefill_inputs(
        batch=1, prefill_len=PREFILL, dtype=torch.float32, device="cpu"
    )
    with torch.no_grad():
        with applied(spec, backend="extraction"):
            expected = kadapts(runtime.PrefillWrapper)(ids, mask, positions)
        with module.patches_applied():
            got = module.prefill_wrapper(ours)(ids, mask, positions)
        eager = reference(input_ids=ids).logits
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))
    torch.testing.assert_close(got[0], eager, rtol=0, atol=TOLERANCE)

    roles = state_roles(kinds)
    cache, tokens = module.place_prefill_kv(got[1:], CACHE, kinds), ids
    token = got[0][:, -1].argmax(-1, keepdim=True)
    for step in range(STEPS):
        position = PREFILL + step
        example = module.decode_example_inputs(
            text, "cpu", position=position, max_cache_len=CACHE, dtype=None
        )
        assert [t.shape for t in example[4:]] == [t.shape for t in cache]
        inputs = (token, module.additive_causal_mask(example[2], CACHE, torch.float32), *example[2:4], *cache)
        tokens = torch.cat([tokens, token], dim=1)
        with torch.no_grad():
            with applied(spec, backend="extraction"):
                expected = kadapts(runtime.DecodeWrapper)(*inputs)
            with module.patches_applied():
                got = module.decode_wrapper(ours)(*inputs)
            eager = reference(input_ids=tokens).logits[:, -1:]
        for (layer, role), a, b in zip(roles, expected[1:], got[1:], strict=True):
            assert torch.equal(a, b), f"decode step {step}: layer {layer} {role}"
        assert torch.equal(expected[0], got[0]), f"decode step {step}: logits"
        torch.testing.assert_close(got[0], eager, rtol=0, atol=TOLERANCE)
        closes = (position + 1) % 4 == 0
        for (layer, role), before, after in zip(roles, cache, got[1:], strict=True):
            if role in ("comp", "index_comp"):  # the step writes the entry of the window it closes, only
                written = (before != after).any(dim=-1).flatten().nonzero().flatten().tolist()
                assert written == ([(position + 1) // 4 - 1] if closes else []), (step, layer, role)
        cache, token = list(got[1:]), got[0][:, -1].argmax(-1, keepdim=True)
