"""Exact ties at a DSA indexer's top-k boundary in transformers' reference run.

A DeepSeek sparse-attention indexer keeps the ``index_topk`` best-scored keys. Its scores pass a ReLU,
so in a small random model many are exactly 0; when the k-th and the (k+1)-th best score are equal the
selection has no defined answer, and transformers' dynamic cache and the static graph (other key
order, other kernel) may keep different keys. A verify that departs at such a step names the tie, so
the reader knows the departure is the tie and not a wrong graph. Used only by ``localise``: a passing
verify pays nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class TopkRecorder(TorchFunctionMode):
    """Keeps the input of every ``topk`` called while an indexer's forward runs (the MoE routers' own
    top-k runs outside any indexer and is not kept)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside: int = -1  # layer index of the indexer running now, -1: none
        self.calls: list[tuple[int, torch.Tensor, int]] = []  # (layer, scores, k)

    def __torch_function__(
        self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self.inside >= 0 and func in (torch.topk, torch.Tensor.topk):
            scores, k = args[0], kwargs.get("k", args[1] if len(args) > 1 else None)
            self.calls.append((self.inside, scores.detach().clone(), int(k)))
        return func(*args, **kwargs)

    def take_ties(self) -> tuple[str, ...]:
        """The boundary ties of the top-k calls recorded since the last take (``boundary_ties``)."""
        found, self.calls = boundary_ties(self.calls), []
        return tuple(found)


@contextmanager
def recording_ties(model: nn.Module) -> Iterator[TopkRecorder]:
    """Record every indexer's top-k inputs in ``model`` (modules with ``index_topk`` and a
    ``layer_idx``) for as long as the context is open."""
    recorder = TopkRecorder()
    handles = []
    for module in model.modules():
        if hasattr(module, "index_topk") and hasattr(module, "layer_idx"):
            layer = int(module.layer_idx)
            enter = module.register_forward_pre_hook(lambda *_, i=layer: setattr(recorder, "inside", i))
            handles.append(enter)
            handles.append(module.register_forward_hook(lambda *_: setattr(recorder, "inside", -1)))
    try:
        with recorder:
            yield recorder
    finally:
        for handle in handles:
            handle.remove()


def boundary_ties(calls: list[tuple[int, torch.Tensor, int]]) -> list[str]:
    """For each recorded top-k with a query row whose k-th and (k+1)-th best finite scores are equal,
    ``layer L: ranks k and k+1 both score s`` (in call order; masked keys score -inf and are skipped)."""
    found = []
    for layer, scores, k in calls:
        for values in scores.reshape(-1, scores.shape[-1]):
            ranked = values[torch.isfinite(values)].sort(descending=True).values
            if ranked.numel() > k and ranked[k - 1] == ranked[k]:
                found.append(f"layer {layer}: ranks {k} and {k + 1} both score {ranked[k].item():.6g}")
                break
    return found
