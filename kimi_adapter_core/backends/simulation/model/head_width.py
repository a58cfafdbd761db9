"""Refuse a TP degree at which a family's attention cannot be built for one rank: one that takes its
head width from ``hidden_size / num_attention_heads`` whatever the config's ``head_dim`` says."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from ....errors import KadaptError
from ....spec.model import Spec
from ....structure.model import ModelStructure
from .parallel import heads_per_rank


def refuse_hidden_derived_heads(
    spec: Spec, layers: Sequence[tuple[str, nn.Module]], s: ModelStructure, tp: int
) -> None:
    """Refuse ``tp`` when a module of the attending ``layers`` (traced name, module) sets its
    ``head_dim`` to ``hidden_size / heads`` of one rank rather than the model's head width.

    The per-rank config writes the rank's heads and an explicit ``head_dim``; an attention that ignores
    the latter (StableLM, Persimmon, Fuyu) reads the rank's heads as heads TP times wider, which would
    price TP times a rank's attention and cut a partial rotary to the wrong width. A serving engine
    splits the heads at their own width; building that is beyond the family's code, so simulate
    refuses at the option, naming the class and the config keys, rather than price it wrong."""
    a = s.attention
    if tp == 1 or a.is_mla or "num_heads" not in s.keys:
        return
    heads = heads_per_rank(a, tp)
    derived = s.hidden_size // heads
    # widths the config states for other parts (an indexer's, a compressor's entries): a module of
    # that width keeps its own (DeepSeek-V4's 128-wide indexer is 4096 / 32 at TP 2 by coincidence)
    indexers = [s.indexer, *(c.indexer for c in s.compressors.values())]
    stated = {i.head_dim for i in indexers if i is not None} | {c.head_dim for c in s.compressors.values()}
    for name, layer in layers:
        for path, m in layer.named_modules(prefix=name):
            if getattr(m, "head_dim", None) == derived != a.head_dim and derived not in stated:
                raise KadaptError(
                    f"--tp {tp}: {type(m).__name__} ({path}) takes its head width from config "
                    f"{s.keys.get('hidden_size', 'hidden_size')} / {s.keys['num_heads']} "
                    f"({s.hidden_size} / {heads} heads on one rank = {derived}, not the model's "
                    f"{a.head_dim}), so simulate cannot build one rank of it at TP {tp}; simulate it at "
                    "--tp 1 (`kadapt plan` sizes any TP)",
                    location=spec.locate("gate"),
                )
