"""specs/kimi_k25.yaml's extraction patches keep the model's numbers (tiny random-weight Kimi-K2.5).

Reference: unpatched transformers, eager attention, eager (per-expert loop) MoE. Patched: the
extraction backend's config (eager attention, batched_mm experts) with K1 (functional expand_kv).
Same weights. fp32 logits agree within 1e-5 absolute (batched_mm sums experts in another order).
"""

from __future__ import annotations

from pathlib import Path

import torch
from fixtures.spec_files import TINY_KIMI

from kimi_adapter_core.loading import applied, load_config, load_model
from kimi_adapter_core.patching.gate import is_claimed
from kimi_adapter_core.patching.ledger import APPLIED
from kimi_adapter_core.spec import load_spec

SPEC = Path(__file__).resolve().parents[1] / "specs" / "kimi_k25.yaml"
TOLERANCE = 1e-5


def test_extraction_patches_match_unpatched_logits():
    spec = load_spec(SPEC)
    reference_config = load_config(spec, backend="none", overrides=TINY_KIMI)
    reference_config.text_config._attn_implementation = "eager"
    reference_config.text_config._experts_implementation = "eager"
    torch.manual_seed(0)
    reference = load_model(spec, device="cpu", config=reference_config).eval()
    for router in (m for m in reference.modules() if type(m).__name__ == "DeepseekV3TopkRouter"):
        torch.nn.init.normal_(router.e_score_correction_bias, std=0.1)  # exercise the noaux_tc bias
    ids = torch.randint(3, 128, (2, 9))
    with torch.no_grad():
        expected = reference(input_ids=ids).logits

    config = load_config(spec, backend="extraction", overrides=TINY_KIMI)
    assert config.text_config._experts_implementation == "batched_mm"
    with applied(spec, backend="extraction") as ledger:
        assert ledger.status_of("K1") == APPLIED
        model = load_model(spec, device="cpu", config=config).eval()
        model.load_state_dict(reference.state_dict())
        attention = model.model.language_model.layers[0].self_attn
        assert is_claimed(attention, spec.name) and hasattr(type(attention).expand_kv, "__kadapt_cell__")
        with torch.no_grad():
            found = model(input_ids=ids).logits
    assert found.shape == (2, 9, 128)
    assert torch.allclose(found, expected, atol=TOLERANCE, rtol=0), (found - expected).abs().max()
