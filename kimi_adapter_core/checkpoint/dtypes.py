"""The dtype each weight is loaded in: the ABI dtype, except what transformers' loader keeps float32.

Extraction casts the exported stacks with it, simulation the per-rank model, and generated modules
embed it, so every consumer holds the same dtypes a ``from_pretrained(dtype=...)`` load gives."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..upstream import loader_keeps_fp32


def cast_to_abi_dtype(model: nn.Module, roots: Iterable[nn.Module], dtype: torch.dtype) -> int:
    """Bring the parameters and persistent buffers under ``roots`` (submodules of ``model``) to the ABI
    dtype, as ``from_pretrained(dtype=dtype)`` would load them.

    What transformers' loader keeps float32 (its dtype plan: the MoE router of DeepSeek-V3 since 5.24,
    ``e_score_correction_bias``) stays float32, matched on the parameter's path in ``model`` as the
    loader matches it; non-persistent buffers (rotary ``inv_freq``) keep their dtype because they are
    computed, not loaded. Returns the number of tensors changed; on the meta device this costs nothing.
    """
    keeps_fp32 = loader_keeps_fp32(model, dtype)
    names = {id(module): name for name, module in model.named_modules()}
    changed = 0
    for root in roots:
        prefix = names.get(id(root), "")  # a module outside ``model`` (a simulated MTP projection)
        for module_name, module in root.named_modules(prefix=prefix):
            tensors = [(n, p, True) for n, p in module.named_parameters(recurse=False)]
            tensors += [
                (n, b, False)
                for n, b in module.named_buffers(recurse=False)
                if n not in module._non_persistent_buffers_set
            ]
            for name, tensor, is_param in tensors:
                if not tensor.is_floating_point():
                    continue
                path = f"{module_name}.{name}" if module_name else name
                want = torch.float32 if keeps_fp32(path) else dtype
                if tensor.dtype == want:
                    continue
                if is_param:
                    tensor.data = tensor.data.to(want)
                else:
                    module._buffers[name] = tensor.to(want)
                changed += 1
    return changed
