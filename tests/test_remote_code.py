"""Remote code: the trust gate, TensorCast's P1-P14 against a Kimi-shaped repo, re-import survival."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers.utils
import transformers.utils.import_utils
from fixtures.remote_kimi import IMAGE_TOKEN, write_remote_model

from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.patching import remote
from kimi_adapter_core.patching.ledger import APPLIED, NOT_FOR_BACKEND
from kimi_adapter_core.spec import load_spec
from kimi_adapter_core.spec.model import HubSource

SPEC = Path(__file__).resolve().parents[1] / "specs" / "kimi_k25_remote.yaml"


@pytest.fixture
def model_dir(tmp_path):
    return write_remote_model(tmp_path / "kimi_remote")


@pytest.fixture
def spec():
    return load_spec(SPEC)


def _inputs(device="cpu"):
    ids = torch.tensor([[1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 2, 3]], device=device)
    pixels = torch.randn(4, 3, 2, 2, device=device)  # 4 patches of 2x2 -> 4 image tokens
    return ids, pixels, torch.tensor([[1, 2, 2]], device=device)


def test_refused_without_both_flags(spec, model_dir):
    with pytest.raises(KadaptError, match=r"must pass --trust-remote-code") as err:
        load_config(spec, source_dir=model_dir)
    assert err.value.location == spec.locate("source")
    with pytest.raises(KadaptError, match=r"must pass --trust-remote-code"):
        with applied(spec, source_dir=model_dir):
            pass
    untrusting = dataclasses.replace(spec, source=dataclasses.replace(spec.source, trust_remote_code=False))
    with pytest.raises(KadaptError, match=r"the spec must set source.trust_remote_code: true"):
        load_config(untrusting, trust_remote_code=True, source_dir=model_dir)
    assert not hasattr(transformers.utils, "is_torch_fx_available")


def test_hub_remote_code_needs_a_commit_pin(spec):
    hub = dataclasses.replace(spec.source, hub=HubSource("moonshotai/Kimi-K2.5", "main"))
    with pytest.raises(KadaptError, match="must pin the hub revision to a full 40-character commit sha"):
        load_config(dataclasses.replace(spec, source=hub), trust_remote_code=True, from_hub=True)


def test_applied_runs_upstream_code_with_all_patches(spec, model_dir):
    with applied(spec, backend="simulation", trust_remote_code=True, source_dir=model_dir) as ledger:
        assert {e.id for e in ledger.entries if e.section == "patch" and e.status == APPLIED} == {
            "P4",
            "P5",
            "P6",
            "P7",
            "P7b",
            "P8",
            "P10",
            "P11",
            "P14",
        }
        assert transformers.utils.is_torch_fx_available() is True  # P1
        model = load_model(spec, device="cpu").eval()
        ids, pixels, grid = _inputs()
        with torch.no_grad():
            # P4: HF-style image_grid_thw renamed, backend kwargs stashed instead of rejected
            out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, attention_meta="meta-info")
        assert out.logits.shape == (1, 7, 64) and model._extra_forward_kwargs == {
            "attention_meta": "meta-info"
        }
        encoder = model.vision_tower.encoder
        assert encoder.use_deterministic_attn is False  # P6
        moe = model.language_model.model.layers[1].mlp
        hidden = torch.randn(1, 5, 32)
        assert torch.equal(moe(hidden), torch.zeros_like(hidden))  # P7
        index, weight = moe.gate(hidden)  # P8: round-robin, 1/top_k
        assert index.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]] and torch.all(weight == 0.5)
        attn = model.language_model.model.layers[0].self_attn
        cos, _ = attn.rotary_emb(hidden, seq_len=torch.tensor(5))  # P14: tensor seq_len
        assert cos.shape[0] == 5
        embed = model.vision_tower.patch_embed  # P11: flat 2-D patches == 4-D conv input
        assert torch.allclose(embed(pixels.reshape(4, -1), grid), embed(pixels, grid), atol=1e-6)

        meta = load_model(spec, device="meta")  # P5: the whole multimodal forward on meta
        ids, pixels, grid = _inputs("meta")
        logits = meta(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits
        assert logits.device.type == "meta" and logits.shape == (1, 7, 64)

        unclaimed = type(model)(model.config)  # same remote classes, not built for the spec
        with pytest.raises(TypeError):
            unclaimed(input_ids=ids, pixel_values=pixels, image_grid_thw=grid)
        with pytest.raises(AttributeError):
            unclaimed.vision_tower.encoder.use_deterministic_attn  # noqa: B018
    assert not hasattr(transformers.utils, "is_torch_fx_available")
    assert not hasattr(transformers.utils.import_utils, "is_torch_fx_available")
    assert not hasattr(type(model).forward, "__kadapt_cell__")
    with pytest.raises(TypeError):  # restored: upstream signature again
        model(input_ids=_inputs()[0], pixel_values=_inputs()[1], image_grid_thw=_inputs()[2])


def test_backend_none_skips_simulation_stubs(spec, model_dir):
    with applied(spec, backend="none", trust_remote_code=True, source_dir=model_dir) as ledger:
        assert [ledger.status_of(i) for i in ("P7", "P8", "P11")] == [NOT_FOR_BACKEND] * 3
        model = load_model(spec, device="cpu")
        hidden = torch.randn(1, 5, 32)
        assert not torch.equal(model.language_model.model.layers[1].mlp(hidden), torch.zeros_like(hidden))


def test_patches_survive_a_forced_reimport(spec, model_dir):
    from transformers.dynamic_module_utils import get_class_from_dynamic_module

    reference = "modeling_kimi_k25.KimiK25ForConditionalGeneration"
    with applied(spec, backend="none", trust_remote_code=True, source_dir=model_dir):
        old = get_class_from_dynamic_module(reference, str(model_dir))
        assert hasattr(old.forward, "__kadapt_cell__")
        fresh = get_class_from_dynamic_module(reference, str(model_dir), force_download=True)
        assert fresh is not old and hasattr(fresh.forward, "__kadapt_cell__")
        encoder_cls = remote.module_of(fresh).MoonViT3dEncoder
        assert "use_deterministic_attn" in vars(encoder_cls)
        model = load_model(spec, device="cpu")
        assert type(model) is fresh
        ids, pixels, grid = _inputs()
        assert model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits.shape == (1, 7, 64)
    assert not hasattr(old.forward, "__kadapt_cell__") and not hasattr(fresh.forward, "__kadapt_cell__")
    assert "use_deterministic_attn" not in vars(encoder_cls)
