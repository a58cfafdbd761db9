"""The guide's per-family spec entries (docs/writing-a-spec.md, "Which bridges a family needs"): the
class patches a model type's own code needs to export and the ``architecture.fields`` its config needs,
as the family matrix's spec builder (``trial.write_spec``) writes them, the same fields a user writes.
"""

from __future__ import annotations

from typing import Any

_LLAMA4 = "transformers.models.llama4.modeling_llama4"
_DEEPSEEK_V2 = "transformers.models.deepseek_v2.modeling_deepseek_v2"
_FALCON = "transformers.models.falcon.modeling_falcon"
_MPT = "transformers.models.mpt.modeling_mpt"
_GPT_NEO = "transformers.models.gpt_neo.modeling_gpt_neo"
_DEEPSEEK_V4 = "transformers.models.deepseek_v4.modeling_deepseek_v4"
# The class patches the guide names for a model type whose own code needs a builtin to export
# (docs/writing-a-spec.md, "Which bridges a family needs"): model type -> its patches, pinned to the
# transformers release the matrix runs on (a release that changes the code refuses them: upstream drift).
_LLAMA4_PATCHES: tuple[dict[str, Any], ...] = (
    {
        "id": "L1",
        "why": "complex freqs_cis become real (cos, sin), the form the wrappers pass on",
        "target": f"{_LLAMA4}:Llama4TextRotaryEmbedding.forward",
        "kind": "replace",
        "impl": "builtin:llama4_rotary_cos_sin",
        "backends": ["extraction"],
        "pin": [
            {
                "transformers": "5.23.0",
                "signature": "(self, x, position_ids)",
                "source_sha256": "e09f3552503f29610a1eca59de16877e8bff34b64dd0596c3159ca2470ca3805",
            },
            {
                "transformers": "5.24.0",
                "signature": "(self, x, position_ids)",
                "source_sha256": "8f2fa823a60a9eb365d0bcbc8b5b24893f37192cdafa6421a3371826e8db8e57",
            },
        ],
    },
    {
        "id": "L2",
        "why": "rope from (cos, sin) in real math; the NoPE layers' temperature from each row's position",
        "target": f"{_LLAMA4}:Llama4TextAttention.forward",
        "kind": "replace",
        "impl": "builtin:llama4_attention_forward",
        "backends": ["extraction"],
        "pin": [
            {
                "transformers": "5.23.0",
                "source_sha256": "a370ae0caed0afdb98bd9686d2c5bf4cf8ab87e89c542221a5ae12a40b70295e",
            },
            {
                "transformers": "5.24.0",
                "source_sha256": "a77422c908cc05c7c0ba0ba26a24cbe1581a902dd6906a554bf7faab2e69c1bf",
            },
        ],
    },
)


def _compact_delta_scan(module: str, layer: str, pin_5_23: str, pin_5_24: str) -> tuple[dict[str, Any], ...]:
    """The gated DeltaNet's export-time scan with a block inverse (``builtins/delta_scan.py``), as
    ``specs/qwen3_next.yaml`` declares it: the layer's forward pinned on both releases' sources."""
    return (
        {
            "id": "G1",
            "why": "the gated DeltaNet scan's 63-step triangular loop, traced as ~800 nodes per layer, as a "
            "log-depth block inverse",
            "target": f"transformers.models.{module}.modeling_{module}:{layer}.forward",
            "kind": "wrap",
            "impl": "builtin:compact_delta_scan",
            "backends": ["extraction"],
            "pin": [
                {"transformers": "5.23.0", "source_sha256": pin_5_23},
                {"transformers": "5.24.0", "source_sha256": pin_5_24},
            ],
        },
    )


_QWEN3_5_SCAN = _compact_delta_scan(
    "qwen3_5",
    "Qwen3_5GatedDeltaNet",
    "e9febb8c7d8be936343363f577a2d20b61dca7b2c5967d068baa12c02425157e",
    "49dac15b219dcafc01413c2c13b94895c82ca8c61ae7c4adb2076647b57561b6",
)
_QWEN3_5_MOE_SCAN = _compact_delta_scan(
    "qwen3_5_moe",
    "Qwen3_5MoeGatedDeltaNet",
    "e9febb8c7d8be936343363f577a2d20b61dca7b2c5967d068baa12c02425157e",
    "49dac15b219dcafc01413c2c13b94895c82ca8c61ae7c4adb2076647b57561b6",
)

GUIDE_PATCHES: dict[str, tuple[dict[str, Any], ...]] = {
    # gated DeltaNet stacks whose eager scan is transformers' solve_triangular (Kimi-Linear's and Bailing's
    # scans run the loop eagerly too, so their bf16 graphs stay bit-identical without the wrap)
    "qwen3_5": _QWEN3_5_SCAN,
    "qwen3_5_text": _QWEN3_5_SCAN,
    "qwen3_5_moe": _QWEN3_5_MOE_SCAN,
    "qwen3_5_moe_text": _QWEN3_5_MOE_SCAN,
    "qwen3_next": _compact_delta_scan(
        "qwen3_next",
        "Qwen3NextGatedDeltaNet",
        "a5c1b27444531b31dc2cf93aae4870341a8a81d9889c1fa5a2c098c7b8454973",
        "ae37b2fcb1d51f1ce0b6f24b8d086fc91412267755627022c30fdd3f8f29e190",
    ),
    "olmo_hybrid": _compact_delta_scan(
        "olmo_hybrid",
        "OlmoHybridGatedDeltaNet",
        "1c77261ce5e9e95777eb7d928948a1b66bd8e7c15ed10d1f7af719a6cebb0ad7",
        "ebbcf092238236e24bbe524bde6d3ef799055d781bca8f26c1f3648f00c05576",
    ),
    "gpt_neo": (
        {
            "id": "N1",
            "why": "each row's causal prefix and local window from the ABI's mask, not a buffer sliced by "
            "the cache's length",
            "target": f"{_GPT_NEO}:GPTNeoSelfAttention._attn",
            "kind": "replace",
            "impl": "builtin:gpt_neo_attn",
            "backends": ["extraction"],
            "pin": {
                "signature": "(self, query, key, value, attention_mask=None)",
                "source_sha256": "39d314cacd051131ca1f05b3b3b1ac6d758461427ab10e6244425a7c751947cd",
            },
        },
    ),
    "falcon": (
        {
            "id": "F1",
            "why": "key and value heads by slices: a list index exports as a constant, valueless on meta",
            "target": f"{_FALCON}:FalconAttention._split_heads",
            "kind": "replace",
            "impl": "builtin:falcon_split_heads_slices",
            "backends": ["extraction"],
            "pin": {
                "signature": (
                    "(self, fused_qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]"
                ),
                "source_sha256": "37894faf93b0c9d5ae3146421d6ee29c2482130f72c49a9dedf4979614d2370a",
            },
        },
    ),
    "mpt": (
        {
            "id": "M1",
            "why": "ALiBi sliced by the key length alone (no cache length read per row); additive mask",
            "target": f"{_MPT}:MptAttention.forward",
            "kind": "replace",
            "impl": "builtin:mpt_attention_forward",
            "backends": ["extraction", "simulation"],  # simulate then refuses its inline attention by name
            "pin": {
                "signature": (
                    "(self, hidden_states: torch.Tensor, position_bias: torch.Tensor, cache: "
                    "transformers.cache_utils.Cache | None = None, "
                    "attention_mask: torch.Tensor | None = None, **kwargs)"
                ),
                "source_sha256": "61b00d0a061a40a476a3a5f896708981e8f2d706087c3dc3200fad6ad9ae0fbf",
            },
        },
    ),
    "llama4_text": _LLAMA4_PATCHES,
    # the multimodal type: the same text classes, under Llama4ForConditionalGeneration's language model
    "llama4": _LLAMA4_PATCHES,
    "deepseek_v2": (
        {
            "id": "D1",
            "why": "complex freqs_cis become real (cos, sin), the form the wrappers pass on",
            "target": f"{_DEEPSEEK_V2}:DeepseekV2RotaryEmbedding.forward",
            "kind": "replace",
            "impl": "builtin:deepseek_v2_rotary_cos_sin",
            "backends": ["extraction"],
            "pin": {
                "signature": "(self, x, position_ids)",
                "source_sha256": "8f2fa823a60a9eb365d0bcbc8b5b24893f37192cdafa6421a3371826e8db8e57",
            },
        },
        {
            "id": "D2",
            "why": "the rope of q_pe and k_pe from (cos, sin) in real math; the latents cached as upstream's",
            "target": f"{_DEEPSEEK_V2}:DeepseekV2Attention.forward",
            "kind": "replace",
            "impl": "builtin:deepseek_v2_attention_forward",
            "backends": ["extraction"],
            "pin": {"source_sha256": "f84d31d933d5f7b2611ae72460c93084733b6ed81da5407a7dff963df11e86b9"},
        },
    ),
}

# The class patches the guide names for a layer type whose code needs a builtin to export, added to a
# family's where its config lists that type (DeepSeek-V4's compressed layers: a stack of sliding layers
# alone needs none, and its generated module carries no wrap), pinned per release: the compressors'
# forwards were reviewed against transformers 5.23's sources and 5.24's, which differ.
GUIDE_LAYER_PATCHES: dict[str, tuple[dict[str, Any], ...]] = {
    "heavily_compressed_attention": (
        {
            "id": "V1",
            "why": "the HCA compressor's open window and entries in the static cache, per row (upstream "
            "grows them by concatenation and counts entries in a Python int for the whole batch)",
            "target": f"{_DEEPSEEK_V4}:DeepseekV4HCACompressor.forward",
            "kind": "wrap",
            "impl": "builtin:deepseek_v4_hca_compressor",
            "backends": ["extraction"],
            "pin": [
                {
                    "transformers": "5.23.0",
                    "source_sha256": "d3bfb74b252d12facf9e68ce710e926dcf1e2a66aaed268848e04ead42317977",
                },
                {
                    "transformers": "5.24.0",
                    "source_sha256": "fe93d160eee3c9b08574d00bac8c4a55e510a77e1a3e5502eb2df825ba6f39c9",
                },
            ],
        },
    ),
    "compressed_sparse_attention": (
        {
            "id": "V2",
            "why": "the CSA compressor's two-window ring and entries in the static cache, per row, and each "
            "query's view of the entries its indexer picks (upstream concatenates, counts entries in a "
            "Python int and keeps the previous window's first series apart)",
            "target": f"{_DEEPSEEK_V4}:DeepseekV4CSACompressor.forward",
            "kind": "wrap",
            "impl": "builtin:deepseek_v4_csa_compressor",
            "backends": ["extraction"],
            "pin": [
                {
                    "transformers": "5.23.0",
                    "source_sha256": "9b8a1dcdd447aa66aed9bbae54113b7b10c48b5341b129380a81e1ae1e6b7e09",
                },
                {
                    "transformers": "5.24.0",
                    "source_sha256": "96a32e9bf30e10d682d944a792a3b549691e89c6eb36cef040951e697cf64a14",
                },
            ],
        },
        {
            "id": "V3",
            "why": "the Lightning indexer's compressed keys in the static cache and a static top-k over each "
            "entry slot, those not closed hidden (upstream's top-k runs over the entries it has)",
            "target": f"{_DEEPSEEK_V4}:DeepseekV4Indexer.forward",
            "kind": "wrap",
            "impl": "builtin:deepseek_v4_indexer",
            "backends": ["extraction"],
            "pin": [
                {
                    "transformers": "5.23.0",
                    "source_sha256": "0d79ce39e8c075955fa4fc904a007a25f3e0b3fb9d39ceb3e233c979c1a157cb",
                },
                {
                    "transformers": "5.24.0",
                    "source_sha256": "2c64d711f0e15b8050941751a81d51d374fe9f81f2e5f8a19c4c0d48ffc6be19",
                },
            ],
        },
    ),
}
# The ``architecture.fields`` the guide states for a family whose config keys a fact under a name
# ``config_keys.yaml`` does not list for every family (GPT-Neo: which layers are local, their window)
GUIDE_FIELDS: dict[str, dict[str, str]] = {
    "gpt_neo": {"layer_types": "attention_layers", "sliding_window": "window_size"},
}
