"""The apply engine: call-time gate, patch kinds, idempotence, restore, all-or-nothing, drift."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from fixtures.spec_files import tiny_kimi_config, write_spec

from kimi_adapter_core.errors import KadaptError
from kimi_adapter_core.loading import applied, load_model, submodule
from kimi_adapter_core.patching import gate, pins
from kimi_adapter_core.patching.ledger import APPLIED, GATED_OFF, NOT_FOR_BACKEND, SKIPPED
from kimi_adapter_core.patching.session import _active
from kimi_adapter_core.spec import load_spec

DSV3 = "transformers.models.deepseek_v3.modeling_deepseek_v3"

TOY = """
import torch
from torch import nn

CALLS = []


class Toy(nn.Module):
    flavour = "plain"

    def forward(self, x, scale=1.0):
        return x * scale

    def pair(self, x):
        return x, x + 1

    def merge(self, features, embeds):
        rows = torch.nonzero(embeds[..., 0] > 0)  # needs values: fails on meta
        return embeds + rows.numel() * 0


def doubled(self, x, scale=1.0):
    CALLS.append(type(self).__name__)
    return x * scale * 2


def plus_hundred(original, self, x, **kwargs):
    return original(self, x, **kwargs) + 100


def expand_kv_spy(self, kv_nope, k_rot):
    CALLS.append(type(self).__name__)
    batch, _, seq, _ = kv_nope.shape
    kv = self.kv_b_proj(kv_nope).view(batch, seq, -1, self.qk_nope_head_dim + self.v_head_dim).transpose(1, 2)
    k_nope, value = torch.split(kv, [self.qk_nope_head_dim, self.v_head_dim], dim=-1)
    return torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1), value
"""

HEAD = """
gate:
  model_type: kimi_k25
  sub_configs:
    text_config: [deepseek_v3, kimi_k2]
source:
  config: model/config.json
module_paths:
  language_model: model.language_model
  language_layers: model.language_model.layers
  lm_head: lm_head
patches:
"""


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """An importable module ``kadapt_toy`` (fresh per test) holding toy targets and impls."""
    (tmp_path / "kadapt_toy.py").write_text(TOY, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("kadapt_toy", None)
    import kadapt_toy

    yield kadapt_toy
    sys.modules.pop("kadapt_toy", None)


def make_spec(tmp_path, patches: str):
    return load_spec(write_spec(tmp_path, HEAD + textwrap.dedent(patches), config=tiny_kimi_config()))


def test_gate_isolates_a_shared_class(tmp_path, toy):
    """With the spec applied, a plain deepseek_v3 model runs the original method, bit for bit."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention

    original = vars(DeepseekV3Attention)["expand_kv"]
    spec = make_spec(
        tmp_path,
        f"""
        - id: K1
          why: spy on the shared class
          target: {DSV3}:DeepseekV3Attention.expand_kv
          kind: replace
          impl: kadapt_toy:expand_kv_spy
        """,
    )
    torch.manual_seed(0)
    cfg = DeepseekV3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=8,
        q_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=4,
        v_head_dim=8,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
    )
    cfg._attn_implementation = "eager"
    plain = DeepseekV3ForCausalLM(cfg).eval()
    ids = torch.randint(0, 64, (1, 6))
    with torch.no_grad():
        before = plain(ids).logits
        with applied(spec, backend="none") as ledger:
            assert ledger.status_of("K1") == APPLIED
            assert vars(DeepseekV3Attention)["expand_kv"] is not original
            during = plain(ids).logits
            built_inside = DeepseekV3ForCausalLM(cfg).eval()  # same class, not built for the spec
            built_inside(ids)
            assert toy.CALLS == []
            kimi = load_model(spec, device="cpu").eval()
            kimi(input_ids=torch.randint(0, 128, (1, 5)))
            assert toy.CALLS == ["DeepseekV3Attention"] * len(submodule(kimi, spec, "language_layers"))
        after = plain(ids).logits
    assert torch.equal(before, during) and torch.equal(before, after)
    assert vars(DeepseekV3Attention)["expand_kv"] is original


def test_kinds_wrap_adapt_return_meta_stub_set_attribute(tmp_path, toy):
    spec = make_spec(
        tmp_path,
        """
        - id: W
          why: wrap with kwarg reshaping
          target: kadapt_toy:Toy.forward
          kind: wrap
          impl: kadapt_toy:plus_hundred
          options: {rename_kwargs: {factor: scale}, allow_kwargs: [scale], stash_extra_as: _extra}
        - id: A
          why: three values
          target: kadapt_toy:Toy.pair
          kind: adapt_return
          options: {arity: 3}
        - id: M
          why: meta inputs
          target: kadapt_toy:Toy.merge
          kind: meta_stub
        - id: S
          why: missing attribute
          target: kadapt_toy:Toy.use_deterministic_attn
          kind: set_attribute
          value: false
          options: {only_if_missing: true}
        - id: S2
          why: present attribute
          target: kadapt_toy:Toy.flavour
          kind: set_attribute
          value: true
          options: {only_if_missing: true}
        - id: E
          why: extraction only
          target: kadapt_toy:Toy.forward
          kind: replace
          impl: kadapt_toy:doubled
          backends: [extraction]
        """,
    )
    ours, theirs = toy.Toy(), toy.Toy()
    x = torch.ones(2)
    with applied(spec, backend="none") as ledger:
        assert ledger.status_of("S2") == GATED_OFF and ledger.status_of("E") == NOT_FOR_BACKEND
        gate.claim_model(ours, spec.name)
        assert torch.equal(ours(x, factor=3.0, attention_meta="m"), x * 3 + 100)
        assert ours._extra == {"attention_meta": "m"}
        ours(x)
        assert ours._extra == {}  # reset per call: nothing leaks into the next call
        assert len(ours.pair(x)) == 3 and ours.pair(x)[2] is None
        meta = ours.merge(torch.empty(3, 4, device="meta"), torch.empty(2, 5, 4, device="meta"))
        assert meta.device.type == "meta" and meta.shape == (3, 4)  # shaped like the first tensor
        assert torch.equal(ours.merge(None, torch.ones(2, 5, 4)), torch.ones(2, 5, 4))
        assert ours.use_deterministic_attn is False
        # an unclaimed instance of the same class sees upstream behaviour everywhere
        with pytest.raises(TypeError):
            theirs(x, factor=3.0)
        assert len(theirs.pair(x)) == 2
        with pytest.raises(AttributeError):
            theirs.use_deterministic_attn  # noqa: B018
    assert "use_deterministic_attn" not in vars(toy.Toy)
    assert len(ours.pair(x)) == 2 and toy.CALLS == []


def test_reapply_is_noop_and_exception_restores(tmp_path, toy):
    spec = make_spec(
        tmp_path,
        """
        - {id: R, why: replace, target: "kadapt_toy:Toy.forward", kind: replace, impl: "kadapt_toy:doubled"}
        """,
    )
    original = vars(toy.Toy)["forward"]
    with pytest.raises(RuntimeError, match="boom"):
        with applied(spec, backend="none"):
            patched = vars(toy.Toy)["forward"]
            with applied(spec, backend="none") as inner:
                assert {e.status for e in inner.entries} == {SKIPPED}
                assert vars(toy.Toy)["forward"] is patched  # not patched twice
            assert vars(toy.Toy)["forward"] is patched  # inner exit does not revert
            raise RuntimeError("boom")
    assert vars(toy.Toy)["forward"] is original and not _active
    with pytest.raises(KadaptError, match="already applied for backend none"):
        with applied(spec, backend="none"), applied(spec, backend="extraction"):
            pass


def test_all_or_nothing_with_close_names(tmp_path, toy):
    spec = make_spec(
        tmp_path,
        """
        - {id: OK, why: fine, target: "kadapt_toy:Toy.forward", kind: replace, impl: "kadapt_toy:doubled"}
        - {id: BAD, why: typo, target: "kadapt_toy:Toy.pairs", kind: adapt_return, options: {arity: 3}}
        """,
    )
    original = vars(toy.Toy)["forward"]
    with pytest.raises(KadaptError, match=r"Toy has no attribute 'pairs'; close names: pair") as err:
        with applied(spec, backend="none"):
            pass
    assert err.value.location == spec.locate("patches[1]")
    assert vars(toy.Toy)["forward"] is original and not _active
    bad_impl = make_spec(
        tmp_path,
        '- {id: I, why: x, target: "kadapt_toy:Toy.forward", kind: replace, impl: "kadapt_toy:doubld"}\n',
    )
    with pytest.raises(KadaptError, match="has no 'doubld'; close names: doubled"):
        with applied(bad_impl, backend="none"):
            pass


def test_drift_pin_refuses_with_expected_found_and_line(tmp_path, toy):
    pin = pins.compute(toy.Toy.forward)
    good = make_spec(
        tmp_path,
        f"""
        - id: P
          why: pinned
          target: kadapt_toy:Toy.forward
          kind: replace
          impl: kadapt_toy:doubled
          pin: {{signature: "{pin.signature}", source_sha256: {pin.source_sha256}}}
        """,
    )
    with applied(good, backend="none") as ledger:
        assert ledger.status_of("P") == APPLIED
    drifted = make_spec(
        tmp_path,
        f"""
        - id: P
          why: pinned
          target: kadapt_toy:Toy.forward
          kind: replace
          impl: kadapt_toy:doubled
          pin: {{signature: "(self, x)", source_sha256: "{"0" * 64}"}}
        """,
    )
    with pytest.raises(KadaptError) as err:
        with applied(drifted, backend="none"):
            pass
    text = str(err.value)
    assert "upstream drift" in text and "signature expected (self, x)" in text
    assert (
        f"signature found    {pin.signature}" in text
        and f"source_sha256 found    {pin.source_sha256}" in text
    )
    assert err.value.location == drifted.locate("patches[0]")
    assert not _active


def test_unknown_backend_and_submodule_errors(tmp_path, toy):
    spec = load_spec(write_spec(tmp_path, HEAD.replace("patches:", "patches: []"), config=tiny_kimi_config()))
    with pytest.raises(KadaptError, match="unknown backend 'tpu'"):
        with applied(spec, backend="tpu"):
            pass
    with pytest.raises(
        KadaptError,
        match="no module_paths key 'vision'; valid keys: language_layers, language_model, lm_head",
    ):
        submodule(torch.nn.Module(), spec, "vision")
