"""The compact delta-rule scan (``builtins/delta_scan.py``): its inverse, upstream's scans rebuilt with it.

The spec-level proof is ``--verify`` on the gated-DeltaNet specs (graphs against unpatched transformers);
these tests pin the pieces: the block inverse against forward substitution, each rebuilt scan against
upstream's own function on the same inputs (the export branch, the one the loop is in), the swap being
undone after the call, and a module without the loop left alone.
"""

from __future__ import annotations

import importlib
import inspect
import types

import pytest
import torch

from kimi_adapter_core.builtins import delta_scan


def _forward_substitution(strict_lower: torch.Tensor) -> torch.Tensor:
    """Upstream's loop, as transformers writes it."""
    attn = strict_lower.clone()
    n = attn.shape[-1]
    for i in range(1, n):
        row = attn[..., i, :i].clone()
        sub = attn[..., :i, :i].clone()
        attn[..., i, :i] = row + (row.unsqueeze(-1) * sub).sum(-2)
    return attn + torch.eye(n, dtype=attn.dtype)


@pytest.mark.parametrize("n", [1, 2, 48, 64])  # 48: blocks that do not halve evenly
def test_unit_lower_inverse_is_the_forward_substitution(n: int) -> None:
    generator = torch.Generator().manual_seed(n)
    strict = (torch.randn(3, 2, n, n, generator=generator, dtype=torch.float64) * 0.3).tril(-1)
    compact = delta_scan.unit_lower_inverse(strict)
    torch.testing.assert_close(compact, _forward_substitution(strict), rtol=1e-12, atol=1e-12)
    identity = torch.eye(n, dtype=torch.float64).expand_as(strict)
    torch.testing.assert_close((identity - strict) @ compact, identity, rtol=1e-12, atol=1e-12)


SCANS = [
    ("transformers.models.qwen3_next.modeling_qwen3_next", "torch_chunk_gated_delta_rule", "head"),
    ("transformers.models.qwen3_5_moe.modeling_qwen3_5_moe", "torch_chunk_gated_delta_rule", "head"),
    ("transformers.models.kimi_linear.modeling_kimi_linear", "chunk_kimi_delta_attention", "channel"),
]


def _inputs(decay: str) -> tuple[torch.Tensor, ...]:
    """A batch of 2 x 150 tokens (three chunks, the last one padded), 2 key and 4 value heads (gated
    DeltaNet's grouped heads; KDA: 4 and 4), head dim 16."""
    generator = torch.Generator().manual_seed(0)
    k_heads = 2 if decay == "head" else 4
    shape = (2, 150)

    def draw(*dims: int) -> torch.Tensor:
        return torch.randn(*shape, *dims, generator=generator)

    query, key, value = draw(k_heads, 16), draw(k_heads, 16), draw(4, 16)
    g = -draw(4).abs() * 0.5 if decay == "head" else -draw(4, 16).abs() * 0.5
    beta = torch.rand(*shape, 4, generator=generator)
    return query, key, value, g, beta


@pytest.mark.parametrize(("module_name", "function", "decay"), SCANS)
def test_rebuilt_scan_equals_upstream(
    module_name: str, function: str, decay: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    module = importlib.import_module(module_name)
    rebuilt = delta_scan._rebuilt(inspect.unwrap(getattr(module, function)))
    assert rebuilt is not None, f"{module_name}.{function}: the forward-substitution loop was not found"
    # both take the export branch (gated DeltaNet's eager branch calls solve_triangular instead)
    monkeypatch.setattr(module, "is_torchdynamo_exporting", lambda: True, raising=False)
    monkeypatch.setitem(rebuilt.__globals__, "is_torchdynamo_exporting", lambda: True)
    args = _inputs(decay)
    kwargs = {"use_qk_l2norm_in_kernel": True, "output_final_state": True}
    out, state = rebuilt(*args, **kwargs)
    ref_out, ref_state = getattr(module, function)(*args, **kwargs)
    torch.testing.assert_close(out, ref_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, ref_state, rtol=1e-5, atol=1e-5)


def _reads_the_scan(self: object) -> object:
    return torch_chunk_gated_delta_rule  # noqa: F821 - resolved in the modelling module's globals


def test_the_wrap_swaps_the_scan_only_during_the_call() -> None:
    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    upstream = module.torch_chunk_gated_delta_rule
    # a forward of the modelling module that returns the scan it would call
    forward = types.FunctionType(_reads_the_scan.__code__, vars(module))
    during = delta_scan.compact_delta_scan(forward, object())
    assert during is not upstream and during.__name__ == upstream.__name__
    assert module.torch_chunk_gated_delta_rule is upstream


def test_the_rebuilt_scan_exports_far_fewer_nodes() -> None:
    module = importlib.import_module("transformers.models.qwen3_next.modeling_qwen3_next")
    args = _inputs("head")

    class Scan(torch.nn.Module):
        def __init__(self, scan: object) -> None:
            super().__init__()
            self.scan = scan

        def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
            return self.scan(*inputs, use_qk_l2norm_in_kernel=True)[0]

    nodes = {}
    for label, scan in (("upstream", module.torch_chunk_gated_delta_rule), ("compact", None)):
        scan = scan or delta_scan._swaps(vars(module))["torch_chunk_gated_delta_rule"]
        nodes[label] = len(torch.export.export(Scan(scan), args).graph.nodes)
    assert nodes["compact"] * 4 < nodes["upstream"], nodes


def test_a_module_without_the_loop_swaps_nothing() -> None:
    module = importlib.import_module("transformers.models.llama.modeling_llama")
    assert delta_scan._swaps(vars(module)) == {}
