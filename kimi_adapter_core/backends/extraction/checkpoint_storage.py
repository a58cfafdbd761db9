"""How the checkpoint stores each source tensor: as is, int4 pack-quantized, or FP8 with block scales.

Read from the model config's ``quantization_config`` (the text config's, else the root's) - the same
object transformers and vLLM read - and, when the config says nothing, from the spec's
``quantization`` schemes (which then describe compressed-tensors' pack-quantized layout). Formats:

- ``compressed-tensors`` / ``pack-quantized`` (Kimi-K2.5's routed experts): ``X.weight`` is stored as
  ``X.weight_packed`` (int32 words, 32/bits values each, value ``i`` of a row at bits ``bits*i``,
  offset by ``2**(bits-1)``), ``X.weight_scale`` (one scale per ``group_size`` inputs) and
  ``X.weight_shape`` (the unpacked shape); ``w = (q - 2**(bits-1)) * scale``.
- ``fp8`` with ``weight_block_size`` (DeepSeek-V3): ``X.weight`` in float8_e4m3fn plus
  ``X.weight_scale_inv`` (float32, one per block); ``w = weight * scale_inv[block]``.
- ``mxfp4`` (gpt-oss's routed experts, the stacked ``experts.gate_up_proj`` / ``experts.down_proj``
  of shape ``[E, in, out]``): ``X_blocks`` (uint8 ``[E, out, in/32, 16]``, two e2m1 values a byte,
  low nibble first) and ``X_scales`` (uint8 e8m0 ``[E, out, in/32]``);
  ``w[e, :, o] = e2m1[nibble] * 2**(scale - 127)`` - transposed on disk, as transformers'
  ``convert_moe_packed_tensors`` reads it.

Which tensors: compressed-tensors' ``targets`` (``Linear`` = an ``nn.Linear`` weight, per expert for
fused experts) minus ``ignore``. ``ignore`` entries match the checkpoint module name (the tensor name
without ``.weight``) as compressed-tensors does - ``re:`` prefix a ``re.match``, else the exact name -
and, deliberately more lenient, a plain entry also matches as the name's last dotted components:
Kimi-K2.5 lists ``lm_head`` while its head is ``language_model.lm_head``, and its checkpoint stores
that head in bf16. FP8 applies to every Linear weight but the output head (transformers' rule), MXFP4
to the routed experts; for both, ``modules_to_not_convert`` is matched as transformers matches it
(``not_converted``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from typing import Any

from ...errors import KadaptError
from ...spec.model import QuantScheme

Storage = dict[str, Any]  # the weight map's "storage" block of one source tensor
StorageRule = Callable[[str, tuple[int, ...], bool], "Storage | None"]

PACK_QUANTIZED = "compressed-tensors/pack-quantized"
FP8_BLOCK = "fp8-block"
MXFP4 = "mxfp4"
MXFP4_BLOCK = 32  # e2m1 values per e8m0 scale (OCP microscaling)
# the expert tensors transformers' Mxfp4GptOssExperts stores packed
MXFP4_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


def not_converted(module: str, patterns: tuple[str, ...]) -> bool:
    """``module`` is one a ``quantization_config``'s ``modules_to_not_convert`` leaves unquantized, by
    transformers' own rule (``quantizers_utils.should_convert_module``): a pattern matches as a regex
    from the start up to a module boundary (``model.layers.*.self_attn``, ``lm_head``), or as a suffix.
    Torch-free; simulation sizes weights with it too."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in patterns)


def _matches(module: str, entry: str) -> bool:
    if entry.startswith("re:"):
        return re.match(entry[3:], module) is not None
    return module == entry or module.endswith("." + entry)


def pack_quantized(shape: tuple[int, ...], bits: int, group_size: int, scale_dtype: str) -> Storage:
    """Storage of one ``[rows, cols]`` weight in compressed-tensors' pack-quantized format."""
    rows, cols = shape
    if cols % group_size:
        raise KadaptError(f"weight map: {cols} inputs do not split into int{bits} groups of {group_size}")
    return {
        "format": PACK_QUANTIZED,
        "bits": bits,
        "group_size": group_size,
        "symmetric": True,
        "tensors": {
            "packed": {"suffix": "_packed", "dtype": "int32", "shape": [rows, math.ceil(cols * bits / 32)]},
            "scale": {"suffix": "_scale", "dtype": scale_dtype, "shape": [rows, cols // group_size]},
            "shape": {"suffix": "_shape", "dtype": "int64", "shape": [2]},
        },
        "dequantize": f"w[r, c] = (q[r, c] - {1 << (bits - 1)}) * scale[r, c // {group_size}]",
    }


def fp8_block(shape: tuple[int, ...], block: tuple[int, int]) -> Storage:
    rows, cols = shape
    return {
        "format": FP8_BLOCK,
        "block": list(block),
        "tensors": {
            "weight": {"suffix": "", "dtype": "float8_e4m3fn", "shape": [rows, cols]},
            "scale": {
                "suffix": "_scale_inv",
                "dtype": "float32",
                "shape": [math.ceil(rows / block[0]), math.ceil(cols / block[1])],
            },
        },
        "dequantize": f"w[r, c] = weight[r, c] * scale_inv[r // {block[0]}, c // {block[1]}]",
    }


def mxfp4(shape: tuple[int, ...]) -> Storage:
    """Storage of one stacked ``[experts, in, out]`` expert weight as MXFP4 (transposed on disk)."""
    experts, cols, rows = shape
    if cols % MXFP4_BLOCK:
        raise KadaptError(f"weight map: {cols} inputs do not split into MXFP4 blocks of {MXFP4_BLOCK}")
    blocks, per_block = cols // MXFP4_BLOCK, MXFP4_BLOCK // 2  # two values a byte
    return {
        "format": MXFP4,
        "block": MXFP4_BLOCK,
        "tensors": {
            "blocks": {
                "suffix": "_blocks",
                "dtype": "uint8",
                "shape": [experts, rows, blocks, per_block],
            },
            "scales": {"suffix": "_scales", "dtype": "uint8", "shape": [experts, rows, blocks]},
        },
        "dequantize": (
            "v[e, o, 32*b + 2*j + h] = e2m1[(blocks[e, o, b, j] >> 4*h) & 15] * 2**(scales[e, o, b] - 127); "
            "w = v.transpose(1, 2); e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]"
        ),
    }


def _mxfp4(qc: dict[str, Any]) -> StorageRule:
    skip = tuple(qc.get("modules_to_not_convert") or ())

    def rule(name: str, shape: tuple[int, ...], linear: bool) -> Storage | None:
        if len(shape) != 3 or not name.endswith(MXFP4_TENSORS):
            return None
        if not_converted(name.rpartition(".")[0], skip):  # the experts module holds the tensor
            return None
        return mxfp4(shape)

    return rule


def _compressed_tensors(qc: dict[str, Any], where: str) -> StorageRule:
    if qc.get("format") != "pack-quantized":
        raise KadaptError(
            f"{where}: compressed-tensors format {qc.get('format')!r} is not described (pack-quantized is)"
        )
    groups = []
    for name, group in (qc.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "int" or weights.get("strategy") != "group" or not weights.get("symmetric"):
            raise KadaptError(f"{where}: config_groups.{name} is not symmetric grouped int quantization")
        groups.append((tuple(group.get("targets") or ()), weights))
    ignore = tuple(qc.get("ignore") or ())

    def rule(name: str, shape: tuple[int, ...], linear: bool) -> Storage | None:
        module = name.removesuffix(".weight")
        if module == name or len(shape) != 2 or any(_matches(module, entry) for entry in ignore):
            return None
        for targets, weights in groups:
            if any((t == "Linear" and linear) or (t != "Linear" and _matches(module, t)) for t in targets):
                scale = (weights.get("scale_dtype") or "torch.bfloat16").removeprefix("torch.")
                return pack_quantized(shape, weights["num_bits"], weights["group_size"], scale)
        return None

    return rule


def _fp8(qc: dict[str, Any], head: str) -> StorageRule:
    block = tuple(qc.get("weight_block_size") or ())
    skip = tuple(qc.get("modules_to_not_convert") or ())

    def rule(name: str, shape: tuple[int, ...], linear: bool) -> Storage | None:
        module = name.removesuffix(".weight")
        if not linear or module == head or not_converted(module, skip):
            return None
        return fp8_block(shape, block if len(block) == 2 else shape)  # type: ignore[arg-type]

    return rule


def _schemes(schemes: tuple[QuantScheme, ...]) -> StorageRule:
    import fnmatch

    def rule(name: str, shape: tuple[int, ...], linear: bool) -> Storage | None:
        for scheme in schemes:
            if len(shape) == 2 and name.endswith(".weight") and fnmatch.fnmatchcase(name, scheme.modules):
                return pack_quantized(shape, scheme.bits, scheme.group_size, scheme.scale_dtype)
        return None

    return rule


def quantization_config_of(text: Any, root: Any) -> tuple[dict[str, Any] | None, str]:
    """The text config's ``quantization_config``, else the root's, as a dict, with where it was found.

    ``text`` and ``root`` are config objects or raw JSON dicts (plain ``validate`` reads the latter)."""
    for where, holder in (("text config", text), ("config", root)):
        if isinstance(holder, Mapping):
            qc = holder.get("quantization_config")
        else:
            qc = getattr(holder, "quantization_config", None)
        if qc:
            return (qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)), f"{where} quantization_config"
    return None, "spec quantization"


def storage_rule(
    quantization_config: dict[str, Any] | None, schemes: tuple[QuantScheme, ...], *, head: str, where: str
) -> StorageRule:
    """The rule deciding each source tensor's storage; ``head`` is the output head's module name."""
    if not quantization_config:
        return _schemes(schemes)
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config, where)
    if method == "fp8":
        return _fp8(quantization_config, head)
    if method == "mxfp4":
        return _mxfp4(quantization_config)
    raise KadaptError(
        f"{where}: quant_method {method!r} is not described (compressed-tensors, fp8, mxfp4 are)"
    )
