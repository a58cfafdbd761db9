"""The generated TensorCast profile of ``kimi_k25_remote``, run the way TensorCast runs it.

TensorCast loads the hub config with ``trust_remote_code``, calls the profile's
``hf_config_patch_method(hf_config, model_id)`` and then builds the model (on meta) from that
config. These tests do exactly that against a Kimi-shaped remote-code directory
(``fixtures/remote_kimi.py``) with the committed, generated module imported by path — no kadapt
at run time.
"""

from __future__ import annotations

import ast
import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers.utils
import transformers.utils.import_utils
from fixtures.modules import import_path
from fixtures.remote_kimi import IMAGE_TOKEN, write_remote_model
from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig
from transformers.modeling_utils import PreTrainedModel

REPO = Path(__file__).resolve().parents[1]
PROFILE = REPO / "adapters" / "kimi_k25_remote" / "tensorcast_profile.py"
SIM_PATCHES = ["P4", "P5", "P6", "P7", "P7b", "P8", "P10", "P11", "P14"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_remote_model(tmp_path_factory.mktemp("tensorcast") / "kimi_remote")


@pytest.fixture()
def profile() -> Any:
    module = import_path(PROFILE, "generated_kimi_k25_remote_profile")
    try:
        yield module
    finally:
        module.remove_patches()


def _hub_config(model_dir: Path) -> Any:
    return AutoConfig.from_pretrained(str(model_dir), trust_remote_code=True)


def _build(config: Any, device: str) -> Any:
    with torch.device(device):
        return AutoModelForCausalLM.from_config(config, trust_remote_code=True).eval()


def _inputs(device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    ids = torch.tensor([[1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 2, 3]], device=device)
    return ids, torch.randn(4, 3, 2, 2, device=device), torch.tensor([[1, 2, 2]], device=device)


def _no_shims() -> bool:
    return not hasattr(transformers.utils, "is_torch_fx_available") and not hasattr(
        transformers.utils.import_utils, "is_torch_fx_available"
    )


def test_profile_carries_the_spec_and_stays_standalone(profile: Any) -> None:
    tree = ast.parse(PROFILE.read_text(encoding="utf-8"))
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not any(name.startswith("kimi_adapter_core") for name in imported), imported
    assert "tensor_cast.transformers.custom_model_registry" in imported  # lazily, inside _registry()
    assert [s.id for s in profile.SHIMS] == ["P1", "P1b"]
    assert [p.id for p in profile.PATCHES] == SIM_PATCHES
    assert all(p.remote for p in profile.PATCHES)
    # remote code: TensorCast builds auto_map's class, the one module_paths are rooted at
    assert profile.TENSORCAST_BUILDS == profile.KADAPT_BUILDS == "KimiK25ForConditionalGeneration"
    assert profile.MODULE_PATHS["visual_layers_path_str"] == "vision_tower.encoder.blocks"
    assert profile.MODULE_PATHS["language_layers_path_str"] == "language_model.model.layers"
    assert profile.installed_patches() == []  # importing installs nothing


def test_other_configs_are_untouched_and_install_nothing(profile: Any, model_dir: Path) -> None:
    llama = LlamaConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=32)
    before = llama.to_dict()
    assert profile.hf_config_patch_method(llama, "meta-llama/Llama-3") is llama
    assert llama.to_dict() == before and profile.installed_patches() == [] and _no_shims()
    wrong_text = _hub_config(model_dir)
    wrong_text.text_config.model_type = "llama"  # right root, sub-config outside the gate
    profile.hf_config_patch_method(wrong_text, str(model_dir))
    assert profile.installed_patches() == [] and _no_shims()
    assert not hasattr(wrong_text, "n_routed_experts")


def test_patch_method_installs_gated_idempotent_and_removable_patches(profile: Any, model_dir: Path) -> None:
    config = _hub_config(model_dir)
    assert _no_shims()
    assert profile.hf_config_patch_method(config, str(model_dir)) is config
    assert transformers.utils.is_torch_fx_available() is True  # P1
    assert transformers.utils.import_utils.is_torch_fx_available() is True  # P1b
    assert (config.n_routed_experts, config.vision_config.spatial_merge_size) == (4, 2)  # bridges
    assert profile.installed_patches() == ["P1", "P1b", "claim", *SIM_PATCHES]

    model = _build(config, "cpu")
    cls = type(model)
    patched_forward = vars(cls)["forward"]
    assert patched_forward.__tensorcast_patch__ == ("kimi_k25_remote", "P4")
    profile.hf_config_patch_method(copy.deepcopy(config), str(model_dir))  # a second call: no-op
    assert vars(cls)["forward"] is patched_forward
    assert profile.installed_patches() == ["P1", "P1b", "claim", *SIM_PATCHES]
    assert not hasattr(patched_forward.__wrapped__, "__tensorcast_patch__")  # no dispatcher in a dispatcher

    # P4: HF-style image_grid_thw renamed, backend kwargs stashed instead of rejected
    ids, pixels, grid = _inputs()
    with torch.no_grad():
        out = model(input_ids=ids, pixel_values=pixels, image_grid_thw=grid, attention_meta="m")
    assert out.logits.shape == (1, 7, 64) and model._extra_forward_kwargs == {"attention_meta": "m"}
    assert model.vision_tower.encoder.use_deterministic_attn is False  # P6
    hidden = torch.randn(1, 5, 32)
    moe = model.language_model.model.layers[1].mlp
    assert torch.equal(moe(hidden), torch.zeros_like(hidden))  # P7
    index, weight = moe.gate(hidden)  # P8: round-robin, 1/top_k
    assert index.tolist() == [[0, 1], [2, 3], [0, 1], [2, 3], [0, 1]] and torch.all(weight == 0.5)
    attn = model.language_model.model.layers[0].self_attn
    assert len(attn(hidden, position_ids=torch.arange(5)[None])) == 3  # P10 (arity kept at 3)
    cos, _ = attn.rotary_emb(hidden, seq_len=torch.tensor(5))  # P14: a tensor seq_len
    assert cos.shape[0] == 5
    embed = model.vision_tower.patch_embed  # P11: flat 2-D patches == 4-D conv input
    assert torch.allclose(embed(pixels.reshape(4, -1), grid), embed(pixels, grid), atol=1e-6)

    meta = _build(config, "meta")  # P5: the whole multimodal forward on meta
    assert type(meta) is cls
    ids, pixels, grid = _inputs("meta")
    logits = meta(input_ids=ids, pixel_values=pixels, image_grid_thw=grid).logits
    assert logits.device.type == "meta" and logits.shape == (1, 7, 64)

    # The gate, per call: same classes, but a model whose root config is not kimi_k25 gets originals.
    other = copy.deepcopy(config)
    other.model_type = "not_kimi"
    with torch.device("meta"):
        stranger = cls(other)
    with pytest.raises(TypeError, match="image_grid_thw"):
        stranger(input_ids=ids, pixel_values=pixels, image_grid_thw=grid)
    with pytest.raises(AttributeError, match="use_deterministic_attn"):
        stranger.vision_tower.encoder.use_deterministic_attn  # noqa: B018
    loose_moe = type(moe)(config.text_config)  # built outside any model: not ours either
    assert not torch.equal(loose_moe(hidden), torch.zeros_like(hidden))

    encoder_cls = type(model.vision_tower.encoder)
    assert profile.remove_patches() == ["P1", "P1b", "claim", *SIM_PATCHES]
    assert profile.installed_patches() == [] and _no_shims()
    assert vars(cls)["forward"] is patched_forward.__wrapped__
    assert "use_deterministic_attn" not in vars(encoder_cls)
    assert not hasattr(vars(PreTrainedModel)["post_init"], "__tensorcast_patch__")
    with pytest.raises(TypeError, match="image_grid_thw"):
        model(input_ids=_inputs()[0], pixel_values=_inputs()[1], image_grid_thw=_inputs()[2])
    assert not torch.equal(moe(hidden), torch.zeros_like(hidden))
    assert profile.remove_patches() == []  # removing twice is harmless


def test_runtime_kinds_on_a_shared_local_class(profile: Any) -> None:
    """A local ``module:Class.attr`` target shared by two models: only the gated model is patched."""
    here = __name__

    def impl(original: Any, self: Any, *args: Any, **kwargs: Any) -> Any:
        return ("wrapped", original(self, *args, **kwargs))

    patches = [
        profile.ClassPatch("W", "wrap", here, ("Shared",), "forward", impl=impl),
        profile.ClassPatch("A", "adapt_return", here, ("Shared",), "pair", options={"arity": 3}),
        profile.ClassPatch("S", "set_attribute", here, ("Shared",), "flag", value=True),
    ]
    runtime = profile.PatchRuntime("test_local", profile.gate_matches, [], patches)
    kimi = Shared({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2"}})
    plain = Shared({"model_type": "deepseek_v3"})
    try:
        assert runtime.install({"model_type": "kimi_k25"}, None) == ["W", "A", "S"]
        assert runtime.install({"model_type": "kimi_k25"}, None) == []  # idempotent
        assert kimi.forward(2) == ("wrapped", 4) and plain.forward(2) == 4
        assert kimi.pair() == (1, 2, None) and plain.pair() == (1, 2)
        assert kimi.flag is True
        with pytest.raises(AttributeError):
            plain.flag  # noqa: B018
    finally:
        assert runtime.remove() == ["claim", "W", "A", "S"]
    assert kimi.forward(2) == 4 and kimi.pair() == (1, 2) and "flag" not in vars(Shared)


class Shared:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config

    def forward(self, x: int) -> int:
        return 2 * x

    def pair(self) -> tuple[int, int]:
        return (1, 2)
