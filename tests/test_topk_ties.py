"""A verify that departs where transformers' DSA top-k is tied at its boundary says so.

In a tiny random model the indexer's ReLU'd scores are often exactly 0, so the k-th and (k+1)-th best
can be equal; which tied key is kept then has no defined answer (GLM-5's 200-step verify departed at
step 80 there). ``localise`` records each indexer's top-k inputs in transformers' run and names such
a tie beside the departure.
"""

from __future__ import annotations

import torch
from test_indexed_states import TOPK, tiny_dsa

from kimi_adapter_core.backends.extraction.equivalence.topk_ties import boundary_ties, recording_ties


def test_a_tie_at_the_boundary_is_named_and_one_inside_the_kept_keys_is_not() -> None:
    inf = float("-inf")
    tied = torch.tensor([[[3.0, 0.0, 2.0, 0.0, inf]]])  # top-2 of {3, 2, 0, 0}: no tie at rank 2/3
    at_boundary = torch.tensor([[[3.0, 0.0, 2.0, 0.0, 0.0]]])  # top-3: ranks 3 and 4 both 0
    assert boundary_ties([(0, tied, 2)]) == []
    assert boundary_ties([(1, at_boundary, 3)]) == ["layer 1: ranks 3 and 4 both score 0"]
    # masked keys (-inf) never count as a tie, and fewer visible keys than k + 1 cannot tie
    assert boundary_ties([(2, torch.tensor([[[1.0, inf, inf]]]), 1)]) == []


def test_the_recorder_keeps_each_indexers_topk_and_not_the_routers() -> None:
    model = tiny_dsa()
    prompt = torch.randint(3, model.config.vocab_size, (1, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad(), recording_ties(model) as recorder:
        model(input_ids=prompt)
    layers = model.config.num_hidden_layers
    assert [layer for layer, _, _ in recorder.calls] == list(range(layers))
    for _, scores, k in recorder.calls:
        assert k == TOPK and scores.shape[-2:] == (9, 9)  # one score per (query, visible key)
    # outside the context nothing is recorded, and the hooks are gone
    with torch.no_grad():
        model(input_ids=prompt)
    assert len(recorder.calls) == layers
    assert not any(m._forward_pre_hooks for m in model.modules() if hasattr(m, "index_topk"))
