"""The per-spec contract tests' choice of shipped specs (``fixtures/archetypes.py``) holds every feature a
shipped spec has, and the features see what makes the round trips differ."""

from __future__ import annotations

from pathlib import Path

from fixtures.archetypes import covering, features

SHIPPED = sorted(p.stem for p in (Path(__file__).resolve().parents[1] / "specs").glob("*.yaml"))


def test_the_chosen_specs_hold_every_feature_of_every_shipped_spec() -> None:
    chosen = covering(SHIPPED, first=("llama",))
    assert chosen[0] == "llama" and len(set(chosen)) == len(chosen)
    held = set().union(*(features(name) for name in chosen))
    assert [name for name in SHIPPED if not features(name) <= held] == []


def test_the_features_tell_apart_the_layer_kinds_caches_and_shapes_the_shipped_specs_have() -> None:
    found = set().union(*(features(name) for name in SHIPPED))
    assert {
        "kind:linear", "kind:indexed", "kind:none", "kind:lightning", "mixer:kda", "mixer:gated_delta_net",
        "mixer:mamba2", "mixer:lightning",
        "chunked", "sliding", "kv-layout:latent", "kv-layout:heads", "vision", "nested-text-config",
        "remote-code", "mtp", "storage:fp8", "storage:mxfp4",
    } <= found
    assert "chunked" in features("llama4_scout") and "chunked" not in features("llama")
