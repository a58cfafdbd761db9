"""How the checkpoint stores each source tensor: as is, int4 pack-quantized, or FP8 with block scales.

Read from the config of the checkpoint given, its ``quantization_config`` (the text config's, else the
root's) - the object transformers reads to load that very checkpoint. No ``quantization_config`` means
a dense checkpoint, as it does for transformers; to read a quantized checkpoint whose config is silent,
give the config its ``quantization_config`` (a config bridge ``set``). The spec's ``quantization``
schemes never decide storage: they are claims about the checkpoint (plan/simulate size weights by
them), checked against the ``quantization_config`` - parameters by ``scheme_contradiction`` (plain
``validate`` too), every tensor a scheme's glob covers by ``CheckpointStorage.storage`` - so a spec and
a config that disagree are a located error, and schemes beside a dense config a note. Formats:

- ``compressed-tensors`` / ``pack-quantized`` (Kimi-K2.5's routed experts): ``X.weight`` is stored as
  ``X.weight_packed`` (int32 words, 32/bits values each, value ``i`` of a row at bits ``bits*i``,
  offset by ``2**(bits-1)``), ``X.weight_scale`` (one scale per ``group_size`` inputs) and
  ``X.weight_shape`` (the unpacked shape); ``w = (q - 2**(bits-1)) * scale``.
- ``fp8`` with ``weight_block_size`` (DeepSeek-V3): ``X.weight`` in float8_e4m3fn plus
  ``X.weight_scale_inv`` (float32, one per block; ``scale_fmt: ue8m0``, DeepSeek-V4's: float8_e8m0fnu, a
  power of two in one byte); ``w = weight * scale_inv[block]``. With ``expert_dtype: fp4`` (DeepSeek-V4)
  the routed experts' per-expert weights are FP4 instead (``fp4-e2m1``): ``X.weight`` int8 ``[out, in/2]``
  (two e2m1 values a byte, low nibble first) and ``X.weight_scale_inv`` ``[out, in/32]`` in the
  ``scale_fmt`` dtype - transformers' ``FP8Experts`` layout.
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

import fnmatch
import functools
import math
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import KadaptError
from ..spec.model import QuantScheme

# The weight map's "storage" block of one source tensor. The builders below return one shared block per
# distinct argument set (a Kimi-K2.5 map asks for ~70,000 tensors' storage, nearly all the same block:
# building each afresh made a plan 5x slower, mostly in garbage collection): read it, never mutate it.
Storage = dict[str, Any]
StorageRule = Callable[[str, tuple[int, ...], bool], "Storage | None"]

PACK_QUANTIZED = "compressed-tensors/pack-quantized"
FP8_BLOCK = "fp8-block"
MXFP4 = "mxfp4"
MXFP4_BLOCK = 32  # e2m1 values per e8m0 scale (OCP microscaling)
FP4_E2M1 = "fp4-e2m1"
FP4_BLOCK = 32  # e2m1 values of one row per scale (transformers' FP8Experts: sf_gran_k 32)
# ``scale_fmt`` of an fp8 quantization_config -> the dtype of its scales (transformers' FineGrainedFP8Config)
SCALE_DTYPES = {"float": "float32", "ue8m0": "float8_e8m0fnu"}
EXPERT_DTYPES = ("fp8", "fp4")
# a routed expert's own weight (``mlp.experts.3.gate_proj``, DeepSeek-V4's ``ffn.experts.3.w1``), which
# transformers' fp8 quantizer stores in ``expert_dtype``; a shared expert is an ordinary linear
ROUTED_EXPERT = re.compile(r"(^|\.)experts\.\d+\.")
# the expert tensors transformers' Mxfp4GptOssExperts stores packed
MXFP4_TENSORS = ("experts.gate_up_proj", "experts.down_proj")


def not_converted(module: str, patterns: tuple[str, ...]) -> bool:
    """``module`` is one a ``quantization_config``'s ``modules_to_not_convert`` leaves unquantized, by
    transformers' own rule (``quantizers_utils.should_convert_module``): a pattern matches as a regex
    from the start up to a module boundary (``model.layers.*.self_attn``, ``lm_head``), or as a suffix.
    Torch-free; simulation sizes weights with it too."""
    boundary = r"(?:(?<=\.)|(?=\.|$))"
    return any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in patterns)


def module_matcher(entries: Iterable[str]) -> Callable[[str], bool]:
    """compressed-tensors' target/ignore rule for many entries at once: ``re:<regex>`` matches from the
    start of the module name, any other entry is the module name or a dotted suffix of it.

    One call costs a dict lookup per name level instead of a loop over the entries: a Kimi-K2.5 weight
    map asks it for ~70,000 checkpoint tensors."""
    entries = tuple(entries)  # read twice below: a generator would leave the patterns empty
    names = {entry for entry in entries if not entry.startswith("re:")}
    patterns = [re.compile(entry[3:]) for entry in entries if entry.startswith("re:")]
    lengths = sorted({name.count(".") + 1 for name in names})  # the suffixes worth looking up

    def matches(module: str) -> bool:
        if any(pattern.match(module) for pattern in patterns):
            return True
        parts = module.split(".")
        return any(".".join(parts[-n:]) in names for n in lengths if n <= len(parts))

    return matches


@functools.cache
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


@functools.cache
def fp8_block(shape: tuple[int, ...], block: tuple[int, int], scale_dtype: str = "float32") -> Storage:
    rows, cols = shape
    return {
        "format": FP8_BLOCK,
        "block": list(block),
        "tensors": {
            "weight": {"suffix": "", "dtype": "float8_e4m3fn", "shape": [rows, cols]},
            "scale": {
                "suffix": "_scale_inv",
                "dtype": scale_dtype,
                "shape": [math.ceil(rows / block[0]), math.ceil(cols / block[1])],
            },
        },
        "dequantize": f"w[r, c] = weight[r, c] * scale_inv[r // {block[0]}, c // {block[1]}]",
    }


@functools.cache
def fp4_e2m1(shape: tuple[int, ...], scale_dtype: str) -> Storage:
    """Storage of one routed expert's ``[out, in]`` weight as DeepSeek-V4 ships it (``expert_dtype: fp4``)."""
    rows, cols = shape
    if cols % FP4_BLOCK:
        raise KadaptError(f"weight map: {cols} inputs do not split into FP4 blocks of {FP4_BLOCK}")
    return {
        "format": FP4_E2M1,
        "block": FP4_BLOCK,
        "tensors": {
            "weight": {"suffix": "", "dtype": "int8", "shape": [rows, cols // 2]},
            "scale": {"suffix": "_scale_inv", "dtype": scale_dtype, "shape": [rows, cols // FP4_BLOCK]},
        },
        "dequantize": (
            f"w[r, c] = e2m1[(weight[r, c // 2] >> 4*(c % 2)) & 15] * scale_inv[r, c // {FP4_BLOCK}]; "
            "e2m1 = [0, .5, 1, 1.5, 2, 3, 4, 6, -0, -.5, -1, -1.5, -2, -3, -4, -6]"
        ),
    }


@functools.cache
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


def _names(qc: dict[str, Any], key: str, where: str) -> tuple[str, ...]:
    """A list of module names or patterns (``ignore``, ``modules_to_not_convert``, ``targets``)."""
    value = qc.get(key) or ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise KadaptError(f"{where}: {key} must be a list of module names, found {value!r:.80}")
    return tuple(value)


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise KadaptError(f"{where} must be a mapping, found {value!r:.80}")
    return value


def _positive(weights: dict[str, Any], key: str, where: str, allowed: tuple[int, ...] = ()) -> int:
    value = weights.get(key)
    ok = isinstance(value, int) and not isinstance(value, bool) and value > 0
    if not ok or (allowed and value not in allowed):
        expected = f"one of {', '.join(map(str, allowed))}" if allowed else "a positive integer"
        raise KadaptError(f"{where}.{key}: expected {expected}, found {value!r:.80}")
    return value


def _mxfp4(qc: dict[str, Any], where: str) -> StorageRule:
    skip = _names(qc, "modules_to_not_convert", where)

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
    for name, group in _mapping(qc.get("config_groups") or {}, f"{where}: config_groups").items():
        at = f"{where}: config_groups.{name}"
        weights = _mapping(_mapping(group, at).get("weights") or {}, f"{at}.weights")
        if weights.get("type") != "int" or weights.get("strategy") != "group" or not weights.get("symmetric"):
            raise KadaptError(f"{at} is not symmetric grouped int quantization")
        _positive(weights, "num_bits", f"{at}.weights", allowed=(1, 2, 4, 8))
        _positive(weights, "group_size", f"{at}.weights")
        targets = _names(group, "targets", at)
        groups.append(("Linear" in targets, module_matcher(t for t in targets if t != "Linear"), weights))
    ignored = module_matcher(_names(qc, "ignore", where))

    def rule(name: str, shape: tuple[int, ...], linear: bool) -> Storage | None:
        module = name.removesuffix(".weight")
        if module == name or len(shape) != 2 or ignored(module):
            return None
        for any_linear, targeted, weights in groups:
            if (any_linear and linear) or targeted(module):
                scale = (weights.get("scale_dtype") or "torch.bfloat16").removeprefix("torch.")
                return pack_quantized(shape, weights["num_bits"], weights["group_size"], scale)
        return None

    return rule


def _fp8(qc: dict[str, Any], head: str, where: str) -> StorageRule:
    block = tuple(qc.get("weight_block_size") or ())
    if block and (
        len(block) != 2 or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise KadaptError(
            f"{where}: weight_block_size must be two positive integers, found {list(block)!r:.80}"
        )
    skip = _names(qc, "modules_to_not_convert", where)
    scale_fmt = qc.get("scale_fmt") or "float"
    if scale_fmt not in SCALE_DTYPES:
        described = ", ".join(SCALE_DTYPES)
        raise KadaptError(f"{where}: scale_fmt {scale_fmt!r} is not described ({described} are)")
    expert_dtype = qc.get("expert_dtype") or "fp8"
    if expert_dtype not in EXPERT_DTYPES:
        raise KadaptError(
            f"{where}: expert_dtype {expert_dtype!r} is not described ({', '.join(EXPERT_DTYPES)} are)"
        )
    scale = SCALE_DTYPES[scale_fmt]

    def rule(name: str, shape: tuple[int, ...], linear: bool) -> Storage | None:
        module = name.removesuffix(".weight")
        if not linear or module == head or not_converted(module, skip):
            return None
        if expert_dtype == "fp4" and ROUTED_EXPERT.search(module):
            return fp4_e2m1(shape, scale)
        return fp8_block(shape, block if len(block) == 2 else shape, scale)  # type: ignore[arg-type]

    return rule


def quantization_config_of(text: Any, root: Any) -> tuple[dict[str, Any] | None, str]:
    """The text config's ``quantization_config``, else the root's, as a dict, with where it was found.

    ``text`` and ``root`` are config objects or raw JSON dicts (plain ``validate`` reads the latter)."""
    holders = (("config", root),) if text is root else (("text config", text), ("config", root))
    for where, holder in holders:
        if isinstance(holder, Mapping):
            qc = holder.get("quantization_config")
        else:
            qc = getattr(holder, "quantization_config", None)
        if qc:
            return (qc.to_dict() if hasattr(qc, "to_dict") else dict(qc)), f"{where} quantization_config"
    return None, "config (no quantization_config)"


def _dense(name: str, shape: tuple[int, ...], linear: bool) -> Storage | None:
    return None


def storage_rule(quantization_config: dict[str, Any] | None, *, head: str, where: str) -> StorageRule:
    """The rule deciding each source tensor's storage; ``head`` is the output head's module name.

    No ``quantization_config``: every tensor is stored as is (what transformers loads then)."""
    if not quantization_config:
        return _dense
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quantization_config, where)
    if method == "fp8":
        return _fp8(quantization_config, head, where)
    if method == "mxfp4":
        return _mxfp4(quantization_config, where)
    raise KadaptError(
        f"{where}: quant_method {method!r} is not described (compressed-tensors, fp8, mxfp4 are)"
    )


def describe(storage: Storage | None) -> str:
    """One phrase for a storage block, for messages: ``int4 pack-quantized, groups of 32, bfloat16
    scales``."""
    if storage is None:
        return "dense (stored as is)"
    if storage["format"] == PACK_QUANTIZED:
        scale = storage["tensors"]["scale"]["dtype"]
        return f"int{storage['bits']} pack-quantized, groups of {storage['group_size']}, {scale} scales"
    if storage["format"] == FP8_BLOCK:
        rows, cols = storage["block"]
        return f"float8_e4m3fn with {rows}x{cols} block scales ({storage['tensors']['scale']['dtype']})"
    if storage["format"] == FP4_E2M1:
        return f"fp4 e2m1 with one {storage['tensors']['scale']['dtype']} scale per {storage['block']} inputs"
    return str(storage["format"])


def _claimed(scheme: QuantScheme, name: str, shape: tuple[int, ...]) -> Storage | None:
    """The storage ``scheme`` claims for source tensor ``name``, None when its glob does not cover it
    (a scheme describes 2-D ``X.weight`` tensors, as compressed-tensors quantizes them)."""
    if len(shape) != 2 or not name.endswith(".weight") or not fnmatch.fnmatchcase(name, scheme.modules):
        return None
    return pack_quantized(shape, scheme.bits, scheme.group_size, scheme.scale_dtype)


def undescribed_by_schemes(quantization_config: Mapping[str, Any]) -> str | None:
    """What ``quantization_config`` stores (``quant_method 'mxfp4'``) when no spec ``quantization``
    scheme can describe it - an int scheme is compressed-tensors pack-quantized storage - else None.
    kadapt 0.1.0 ignored a scheme beside such a config (``spec.deprecations`` keeps that for a release)."""
    method = quantization_config.get("quant_method")
    if method == "compressed-tensors" and quantization_config.get("format") == "pack-quantized":
        return None
    form = f", format {quantization_config.get('format')!r}" if method == "compressed-tensors" else ""
    return f"quant_method {method!r}{form}"


def scheme_contradiction(scheme: QuantScheme, quantization_config: dict[str, Any], where: str) -> str | None:
    """What in ``quantization_config`` contradicts ``scheme``, a spec's claim that its modules are
    stored int-``bits`` packed into ``packed_dtype`` words with one ``scale_dtype`` scale per
    ``group_size`` inputs; None when some config group stores exactly that. Torch-free: plain
    ``validate`` runs it on the shipped config, the weight map on the config of the checkpoint given."""
    claim = (
        f"{scheme.modules!r} is int{scheme.bits} packed into {scheme.packed_dtype} words, "
        f"groups of {scheme.group_size}, {scheme.scale_dtype} scales"
    )
    stored = undescribed_by_schemes(quantization_config)
    if stored is not None:
        return f"{claim}, but {where} has {stored} (int schemes describe compressed-tensors pack-quantized)"
    if scheme.packed_dtype != "int32":
        return f"{claim}, but compressed-tensors ({where}) packs into int32 words"
    groups = []
    for group_name, group in (quantization_config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        scale = (weights.get("scale_dtype") or "torch.bfloat16").removeprefix("torch.")
        stated = (weights.get("num_bits"), weights.get("group_size"), scale)
        if stated == (scheme.bits, scheme.group_size, scheme.scale_dtype):
            return None
        groups.append(f"{group_name}: int{stated[0]}, groups of {stated[1]}, {stated[2]} scales")
    return f"{claim}, but {where} has no such config group ({'; '.join(groups) or 'none'})"


@dataclass(frozen=True)
class Claim:
    """A spec ``quantization`` scheme, checked on every checkpoint tensor its glob covers."""

    scheme: QuantScheme
    entry: str  # "quantization[0] (Q1)"
    location: str | None  # file:line:col of the entry


@dataclass(frozen=True)
class CheckpointStorage:
    """The storage of the checkpoint given, with the spec's ``quantization`` claims that hold for it.

    ``storage`` is the one answer for a source tensor: the weight map writes it and the IR's per-weight
    ``quantization`` is read from the map, so the two cannot disagree."""

    rule: StorageRule
    found_in: str | None  # where the quantization_config was read; None: a dense checkpoint
    claims: tuple[Claim, ...] = ()
    notes: tuple[str, ...] = ()  # spec schemes that do not describe this checkpoint, and why

    def storage(self, name: str, shape: tuple[int, ...], linear: bool) -> Storage | None:
        """How ``name`` is stored; a spec scheme covering ``name`` that says otherwise is an error."""
        stored = self.rule(name, shape, linear)
        for claim in self.claims:
            claimed = _claimed(claim.scheme, name, shape)
            if claimed is not None and claimed != stored:
                raise KadaptError(
                    f"{claim.entry}: {claim.scheme.modules!r} covers checkpoint tensor {name} and says it is "
                    f"{describe(claimed)}, but the {self.found_in} stores it {describe(stored)}; the config "
                    "decides what is read: fix the scheme (or the config)",
                    location=claim.location,
                )
        return stored


def checkpoint_storage(
    quantization_config: dict[str, Any] | None,
    found_in: str,
    schemes: tuple[QuantScheme, ...],
    *,
    head: str,
    locate: Callable[[int], str | None],
) -> CheckpointStorage:
    """The storage of the checkpoint whose config holds ``quantization_config`` (found at ``found_in``).

    ``schemes`` are the spec's ``quantization`` entries, ``locate(i)`` the location of entry ``i``. With
    a ``quantization_config`` each scheme must agree with it (else a located ``KadaptError``) and is then
    checked on every tensor its glob covers; without one the checkpoint is dense, as transformers reads
    it, and each scheme only earns a note: it describes another checkpoint (the published one)."""
    if not quantization_config:
        notes = tuple(
            f"quantization[{index}] ({scheme.id}, int{scheme.bits} {scheme.modules!r}) not applied: the "
            "config has no quantization_config, so the checkpoint is read dense, as transformers loads it "
            "(for a quantized checkpoint whose config is silent, set its quantization_config with a config "
            "bridge)"
            for index, scheme in enumerate(schemes)
        )
        return CheckpointStorage(_dense, None, notes=notes)
    rule = storage_rule(quantization_config, head=head, where=found_in)
    claims = []
    for index, scheme in enumerate(schemes):
        entry = f"quantization[{index}] ({scheme.id})"
        problem = scheme_contradiction(scheme, quantization_config, found_in)
        if problem is not None:
            raise KadaptError(f"{entry}: {problem}", location=locate(index))
        claims.append(Claim(scheme, entry, locate(index)))
    return CheckpointStorage(rule, found_in, claims=tuple(claims))
