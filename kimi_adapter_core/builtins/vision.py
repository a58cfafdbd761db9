"""Vision-tower hooks for simulation inputs (TensorCast's P11)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F


def patch_embed_flat_linear(
    original: Callable[..., Any], self: Any, x: torch.Tensor, *args: Any, **kwargs: Any
) -> Any:
    """``wrap`` impl for ``MoonVision3dPatchEmbed.forward`` (remote code) and transformers'
    ``Kimi_K25VisionPatchEmbed.forward``: accept flat 2-D patches.

    Simulators feed patches as ``[L, C*ph*pw]``; the upstream ``Conv2d`` wants ``[L, C, ph, pw]``.
    A conv whose kernel equals the patch is a linear map over the flattened patch, so this computes
    ``x @ proj.weight.flatten(1).T + bias`` and then the upstream position embedding
    ``self.pos_emb(out, grid_thws)``. Other inputs run the original unchanged.
    """
    if x.dim() != 2:
        return original(self, x, *args, **kwargs)
    proj = self.proj
    out = F.linear(x, proj.weight.reshape(proj.weight.shape[0], -1), proj.bias)
    return self.pos_emb(out, *args, **kwargs)


def meta_merged_embeddings(
    self: Any, image_features: Any, inputs_embeds: torch.Tensor, *args: Any, **kwargs: Any
) -> torch.Tensor:
    """``meta_stub`` impl for ``_merge_input_ids_with_image_features`` (TensorCast's P5).

    Merging scatters image features into the text embeddings at the image-token positions, which
    needs real token ids. On meta inputs only the shape matters: the merged sequence has the shape
    and dtype of ``inputs_embeds``.
    """
    return torch.empty(inputs_embeds.shape, dtype=inputs_embeds.dtype, device="meta")
