"""``kadapt simulate --sweep``: price every parallel layout, batch and weight mode for N devices.

Calling ``simulate`` per configuration would build and trace the per-rank model each time (0.1-0.4 s)
for thousands of configurations. A traced step depends on a configuration through a few things
only, and this module measures that dependence instead of assuming it:

- **TP** fixes the per-rank shapes: the per-rank model is built once per TP size (``RankModel``,
  about half of a trace) and traced at every shape the sweep needs (DP = devices / TP).
- **Tokens per rank.** Kernels' FLOPs, bytes and shape facts are affine in the per-rank batch ``b``
  (each op runs on ``b`` x tokens-per-query rows; weights are read once). A TP size is traced at
  b = 2 and b = 3 and each *family* (below) is checked against a trace at the largest b the sweep
  needs: same kernels and the same price for each. b = 1 is a family of its own (eager code takes
  other paths for one row). A family that fails a check is traced per configuration instead,
  exactly as ``simulate`` does. A family's kernels are ``scaling``'s affine entries.
- **Weight formats.** One tagged trace serves every weight mode of a TP size (``weight_modes``: each
  matmul names its weight; ``in_mode`` re-formats and fuses again); modes that merge projections
  alike form one family, repriced per mode through the weights whose format differs; a kernel that
  reads such a weight unnamed (a vector op) sends the family to the per-configuration path.
- **DP and EP** reach the routed experts (dispatch, GEMM, combine: the simulator's ``RoutedExperts``
  per configuration) and the kernels with an ``ep`` attribute, priced per EP size.

Kernels are priced by a pricing callable (``cost.price`` unless given), with ``framework``'s engine
kernels, the step finished and memory sized as ``simulate`` does (``tests/test_sweep.py`` checks
sampled configurations). What a sweep covers and returns (layouts, modes, batches, points) is ``grid``'s.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from ....errors import KadaptError, UsageError
from ....loading import applied
from ....spec.model import Spec
from ..estimate import simulator
from ..estimate.cost import Priced, price
from ..estimate.engine_kernels import engine_kernels
from ..estimate.planner import Memory, activation_bytes, kv_sizing, params_per_device, weight_lines
from ..model.deployment import Deployment
from ..model.inputs import ModelInputs
from ..model.parallel import Parallel
from ..model.quant import WeightFormat
from ..model.rank_config import BACKEND
from ..model.rank_model import RankModel
from ..model.tracer import Op, fuse
from ..tables.device import Device
from .grid import DEFAULT_BATCHES, Config, Point, SweepResult, batch_grid, layouts
from .scaling import Scaled, ScaledExperts, close, expert_kernels, expert_spans, numeric, shape_of, values_of
from .weight_modes import Key, TaggedTrace, Tagger, kernel_family, reformat, tag_index, tagged, untag

Pricer = Callable[[Op, Device], Priced]


class _Family:
    """The kernels of every configuration with one TP size and per-rank batches in ``[at, ...)`` (or
    exactly ``at`` when ``single``), from a few traces (module docstring); ``entries`` is None when
    the family cannot be scaled (``reason`` says why): its configurations are then traced one by one."""

    def __init__(
        self,
        sweep: Sweep,
        tp: int,
        at: int,
        single: bool,
        verify_at: int | None,
        modes: tuple[str | None, ...],
    ) -> None:
        self.sweep, self.tp, self.dp, self.at = sweep, tp, sweep.devices // tp, at
        self.modes, self.base = modes, modes[0]  # traced in the first mode, repriced for the others
        self.entries: list[Scaled | ScaledExperts] | None = None
        self.reason = ""
        self._build(single, verify_at)

    def _dep(self, b: int) -> Deployment:
        return self.sweep.deployment(Parallel(self.tp, self.dp, 1), b * self.dp)

    def _kernels(self, b: int) -> tuple[list[Op], Tagger]:
        """The kernels a tagged trace at per-rank batch ``b`` records in this family's first mode."""
        raw = self.sweep.raw(self.tp, b)
        return self.sweep.in_mode(raw, self.base), raw.tagger

    def _build(self, single: bool, verify_at: int | None) -> None:
        sw = self.sweep
        lo, tagger = self._kernels(self.at)
        hi = lo if single else self._kernels(self.at + 1)[0]
        if [shape_of(o) for o in lo] != [shape_of(o) for o in hi]:
            self.reason = "its kernel list changes with the batch"
            return
        varying = frozenset(k for k in tagger.groups if len({sw.format(q, k) for q in self.modes}) > 1)
        spans = expert_spans(lo)
        entries: list[Scaled | ScaledExperts] = []
        i = 0
        while i < len(lo):
            if i in spans:
                expert = self._experts(lo[i : spans[i]], hi[i : spans[i]], tagger, single)
                if expert is None:
                    return
                entries.append(expert)
                i = spans[i]
                continue
            key, traced = tagger.named(lo[i].compute)
            # elements of the weights whose format differs between the family's modes
            elements = sum(n for _, fmt, n in lo[i].weights if tagger.named(fmt.compute)[0] in varying)
            if elements and key not in varying:
                self.reason = f"kernel {lo[i].name} reads a weight of varying format it does not name"
                return
            entries.append(Scaled(lo[i], hi[i], self.at, key, traced, elements))
            i += 1
        if verify_at is not None and not self._verify(entries, verify_at):
            return
        self.entries = entries

    def _experts(self, lo: list[Op], hi: list[Op], tagger: Tagger, single: bool) -> ScaledExperts | None:
        """The rows each traced routed-experts call ran, found by re-running the module."""
        gemm = next(o for o in lo if o.kind == "experts")
        key, traced = tagger.named(gemm.compute)
        if key is None or traced is None:
            self.reason = "its routed-experts kernel names no weight"
            return None
        rows = []
        for b, ops in ((self.at, lo), (self.at + 1, hi))[: 1 if single else 2]:
            tokens = self._tokens(ops, traced, self._dep(b))
            if tokens is None:
                return None
            rows.append(tokens)
        return ScaledExperts(gemm.module, gemm.scope, gemm.repeat, self.at, rows[0], rows[-1], traced)

    def _tokens(self, ops: list[Op], fmt: WeightFormat, dep: Deployment) -> int | None:
        """The rows of the routed-experts call that recorded ``ops`` (experts in ``fmt``), or None when
        the module does not reproduce them from that count."""
        s = self.sweep.s
        unit = next(o for o in expert_kernels(s, dep, fmt, 1) if o.kind == "experts")
        tokens = round(next(o for o in ops if o.kind == "experts").flops / unit.flops)
        if [values_of(o) for o in expert_kernels(s, dep, fmt, tokens)] != [values_of(o) for o in ops]:
            self.reason = "its routed-experts kernels could not be reproduced"
            return None
        return tokens

    def _real(self, b: int, dep: Deployment) -> list[Op] | None:
        """What an untagged trace at ``b`` in the family's first mode records: the tagged trace,
        re-formatted, with its routed experts re-run in that mode's expert format."""
        kernels, tagger = self._kernels(b)
        spans = expert_spans(kernels)
        real: list[Op] = []
        i = 0
        while i < len(kernels):
            if i not in spans:
                real.append(untag(kernels[i]))
                i += 1
                continue
            chunk = kernels[i : spans[i]]
            gemm = next(o for o in chunk if o.kind == "experts")
            traced = tagger.named(gemm.compute)[1]
            tokens = self._tokens(chunk, traced, dep) if traced is not None else None
            if tokens is None:
                return None
            rerun = expert_kernels(self.sweep.s, dep, self.sweep.routed_format(self.base), tokens)
            real += [replace(o, module=gemm.module, scope=gemm.scope, repeat=gemm.repeat) for o in rerun]
            i = spans[i]
        return real

    def _verify(self, entries: list[Scaled | ScaledExperts], b: int) -> bool:
        """A real trace at ``b`` (the family's first mode, untagged) must give the same kernels at the
        same prices; numeric facts that are not affine (tensor ids) are left out if prices agree."""
        sw, dep = self.sweep, self._dep(b)
        traced = self._real(b, dep)
        if traced is None:
            return False
        predicted = sw.expand(self, entries, b, self.base, dep)
        if [shape_of(o) for o in traced] != [shape_of(o) for _, o in predicted]:
            self.reason = f"its kernel list changes with the batch (checked at {b} per rank)"
            return False
        for real, (entry, guess) in zip(traced, predicted, strict=True):
            if entry is not None:
                entry.opaque = frozenset(
                    k
                    for k, v in real.attrs.items()
                    if numeric(v) and not (numeric(guess.attrs.get(k)) and close(v, guess.attrs[k]))
                )
        mine = sw.finish([op for _, op in sw.expand(self, entries, b, self.base, dep)], dep)
        theirs = sw.finish(traced, dep)
        if not all(
            close(x.op.flops, y.op.flops) and close(x.op.bytes, y.op.bytes) and close(x.time, y.time)
            for x, y in zip(mine, theirs, strict=True)
        ):
            self.reason = f"its kernels are not affine in the batch (checked at {b} per rank)"
            return False
        return True


# --- the sweep --------------------------------------------------------------------------------------
class Sweep:
    """Prices configurations of one model, step shape and device count on one device profile.

    ``inputs`` maps each swept weight mode (None: the checkpoint) to its ``model_inputs``; ``base``
    carries the step shape (query/context length, decode, MTP, KV dtype, routing): its layout and
    batch are replaced per configuration. ``kv_tokens`` sizes each sequence's KV cache when it must
    hold more than the step's context (a request prices decode at its mean context but must fit its
    last token); ``models`` shares built per-rank models between sweeps of one model and spec (keyed
    by TP size and whether MTP drafts are traced); ``framework`` adds its engine kernels."""

    def __init__(
        self,
        spec: Spec,
        inputs: Mapping[str | None, ModelInputs],
        device: Device,
        base: Deployment,
        devices: int,
        *,
        pricer: Pricer | None = None,
        batches: Sequence[int] = DEFAULT_BATCHES,
        kv_tokens: int | None = None,
        models: dict[tuple[int, bool], RankModel] | None = None,
        framework: str | None = None,
    ) -> None:
        if not inputs:
            raise UsageError("a sweep needs at least one weight mode")
        self.spec, self.inputs, self.device, self.base = spec, dict(inputs), device, base
        self.devices, self.batches = devices, batch_grid(batches)
        self.quants, first = tuple(self.inputs), next(iter(self.inputs.values()))
        self.s = first.arch.structure
        self.pricer, self.framework = pricer or price, framework
        self.traces, self.trace_seconds = 0, 0.0
        self._groups = {g.name: g for g in first.groups}
        routed = self._groups.get("routed_experts")
        self.routed_key: Key | None = (routed.name, routed.checkpoint_name) if routed else None
        self._keys = [(g.name, name) for g in first.groups for name, _ in g.tensors()]
        self._formats: dict[tuple[str | None, Key], WeightFormat] = {}
        self.same_as = self._same_weights()
        self.quants = tuple(q for q in self.quants if q not in self.same_as)
        self._families: dict[tuple[int, int, str | None], _Family] = {}
        self._classes: dict[str | None, tuple[str | None, ...]] | None = None
        self._scaled: dict[tuple[Any, ...], list[Priced | ScaledExperts]] = {}
        self._direct: dict[Config, list[Op]] = {}
        self._lines: dict[str | None, tuple[Any, ...]] = {}
        self._kv: dict[int, int] = {}
        # per (TP size, MTP), built once and traced at every shape; a request-level search hands every
        # sweep of one model the same dict, so a prefill and a decode sweep share the built models
        self._models = {} if models is None else models
        self.kv_tokens = kv_tokens  # tokens a sequence's KV cache holds (None: context + new tokens)
        self._raw: dict[tuple[int, int], TaggedTrace] = {}
        replace(base, parallel=Parallel(), batch=1).check(self.s)  # the step shape itself is valid

    # --- plumbing ---------------------------------------------------------------------------------
    def deployment(self, par: Parallel, batch: int) -> Deployment:
        return replace(self.base, parallel=par, batch=batch)

    @property
    def rank_models(self) -> tuple[int, ...]:
        """TP sizes whose per-rank model has been built (once each)."""
        return tuple(dict.fromkeys(tp for tp, _ in self._models))

    def record(self, inputs: ModelInputs, dep: Deployment) -> list[Op]:
        """The ops (before fusion) one step of ``dep`` records with the weights in ``inputs``' formats,
        on the per-rank model of its TP size (built on first use)."""
        self.traces, start = self.traces + 1, time.perf_counter()
        try:
            key = (dep.parallel.tp, bool(dep.mtp))
            model = self._models.get(key)
            if model is None:
                model = self._models[key] = RankModel(self.spec, inputs, dep)
            return model.trace(inputs, dep).ops
        finally:
            self.trace_seconds += time.perf_counter() - start

    def trace(self, inputs: ModelInputs, dep: Deployment) -> list[Op]:
        """The fused kernels ``simulate`` prices for ``dep`` (a real trace, untagged)."""
        return self._fuse(self.record(inputs, dep))

    def _fuse(self, ops: list[Op]) -> list[Op]:
        """``fuse``, then the small kernels the sweep's framework launches around them."""
        return engine_kernels(fuse(ops), self.framework or "", self.base.decode, self.device)

    def raw(self, tp: int, b: int) -> TaggedTrace:
        """The tagged trace at TP ``tp`` and per-rank batch ``b`` in the first swept mode, shared by
        every weight mode (``in_mode``); traced once."""
        found = self._raw.get((tp, b))
        if found is None:
            dp, tagger = self.devices // tp, Tagger(self.inputs[self.quants[0]].policy)
            inputs = replace(self.inputs[self.quants[0]], policy=tagger)
            ops = self.record(inputs, self.deployment(Parallel(tp, dp, 1), b * dp))
            found = self._raw[(tp, b)] = TaggedTrace(ops, tagger)
        return found

    def in_mode(self, raw: TaggedTrace, quant: str | None) -> list[Op]:
        """The fused kernels a trace tagged like ``raw`` records with the weights in ``quant``'s formats:
        each weight's reads re-formatted, then the projections merged and vector ops fused as the
        tracer does (which projections merge depends on the formats' kernel families)."""
        if quant == self.quants[0]:
            return self._fuse(raw.ops)

        def convert(fmt: WeightFormat) -> WeightFormat:
            index = tag_index(fmt.compute)
            return fmt if index is None else tagged(self.format(quant, raw.tagger.keys[index]), index)

        return self._fuse([reformat(op, convert) for op in raw.ops])

    def finish(self, ops: Iterable[Op], dep: Deployment) -> list[Priced]:
        return simulator.finish_step([self.pricer(op, self.device) for op in ops], dep)

    def format(self, quant: str | None, key: Key) -> WeightFormat:
        fmt = self._formats.get((quant, key))
        if fmt is None:
            fmt = self._formats[(quant, key)] = self.inputs[quant].policy(self._groups[key[0]], key[1])
        return fmt

    def _same_weights(self) -> dict[str | None, str | None]:
        """Modes that store every weight as an earlier mode does (Llama's BF16 is its checkpoint):
        mode -> that earlier mode. They would price identically, so they are not swept twice."""
        seen: dict[tuple[WeightFormat, ...], str | None] = {}
        same = {}
        for mode in self.quants:
            formats = tuple(self.format(mode, key) for key in self._keys)
            if formats in seen:
                same[mode] = seen[formats]
            else:
                seen[formats] = mode
        return same

    def modes_with(self, quant: str | None) -> tuple[str | None, ...]:
        """The swept modes one family prices together with ``quant``: those that give the same weights
        the same kernel family (so the tracer merges the same projections). The routed experts are
        left out: they are priced analytically, never merged."""
        if self._classes is None:
            keys = [key for key in self._keys if key[0] != "routed_experts"]
            classes: dict[frozenset[frozenset[Key]], list[str | None]] = {}
            for mode in self.quants:
                by_kernel: dict[str, set[Key]] = {}
                for key in keys:
                    by_kernel.setdefault(kernel_family(self.format(mode, key)), set()).add(key)
                classes.setdefault(frozenset(frozenset(v) for v in by_kernel.values()), []).append(mode)
            self._classes = {mode: tuple(modes) for modes in classes.values() for mode in modes}
        return self._classes[quant]

    def family(self, tp: int, b: int, quant: str | None) -> _Family:
        """The family pricing per-rank batch ``b`` at TP ``tp`` in mode ``quant``: b = 1 alone (eager
        code takes other paths for one row), b >= 2 together."""
        at, modes = min(b, 2), self.modes_with(quant)
        fam = self._families.get((tp, at, modes[0]))
        if fam is None:
            dp = self.devices // tp
            largest = max([x // dp for x in self.batches if x % dp == 0] + [b])
            verify = largest if at == 2 and largest > 3 else None
            fam = self._families[(tp, at, modes[0])] = _Family(self, tp, at, at == 1, verify, modes)
        return fam

    def expand(
        self, fam: _Family, entries: list[Scaled | ScaledExperts], b: int, quant: str | None, dep: Deployment
    ) -> list[tuple[Scaled | None, Op]]:
        """Every kernel at per-rank batch ``b`` in weight mode ``quant``, with the entry it came from."""
        out: list[tuple[Scaled | None, Op]] = []
        for entry in entries:
            if isinstance(entry, Scaled):
                out.append((entry, entry.op(b, *self._formats_of(fam, entry, quant))))
            else:
                out += [(None, op) for op in entry.kernels(self.s, dep, self.routed_format(quant), b)]
        return out

    def _formats_of(
        self, fam: _Family, entry: Scaled, quant: str | None
    ) -> tuple[WeightFormat | None, WeightFormat | None]:
        if entry.key is None:
            return None, None
        return self.format(quant, entry.key), self.format(fam.base, entry.key)

    def routed_format(self, quant: str | None) -> WeightFormat:
        assert self.routed_key is not None
        return self.format(quant, self.routed_key)

    # --- one configuration -----------------------------------------------------------------------
    def kernels(self, config: Config) -> list[Priced]:
        """Every kernel of ``config``'s step, priced and finished as ``simulate`` does, in its order."""
        par, quant = config.parallel, self.same_as.get(config.quant, config.quant)
        if par.devices != self.devices:
            raise UsageError(f"layout {config.layout} does not use the sweep's {self.devices} devices")
        dep = self.deployment(par, config.batch)
        b = dep.batch_per_rank
        fam = self.family(par.tp, b, quant)
        if fam.entries is None:
            ops = self._direct.get(config)
            if ops is None:
                ops = self._direct[config] = self.trace(self.inputs[quant], dep)
            return self.finish(ops, dep)
        priced: list[Priced] = []
        for item in self._scaled_at(fam, b, quant, par):
            if isinstance(item, ScaledExperts):
                priced += [
                    self.pricer(op, self.device)
                    for op in item.kernels(self.s, dep, self.routed_format(quant), b)
                ]
            else:
                priced.append(item)
        return simulator.finish_step(priced, dep)

    def _scaled_at(self, fam: _Family, b: int, quant: str | None, par: Parallel) -> list[Any]:
        """The priced kernels (``Priced | ScaledExperts``) the routed experts do not recompute, at
        ``par``'s EP size (traces: EP 1); under expert TP across DP groups no all-to-all (tokens gathered)."""
        key = (fam.tp, fam.at, b, quant)  # one family per (tp, at, mode): the mode names it
        if (base := self._scaled.get(key)) is None:
            base = self._scaled[key] = [
                self.pricer(e.op(b, *self._formats_of(fam, e, quant)), self.device)
                if isinstance(e, Scaled)
                else e
                for e in fam.entries or []
            ]
        ep, gathered = par.ep, par.moe_tp > 1 and par.dp > 1
        if ep <= fam.tp:  # no all-to-all: no price reads the EP size (``ep_dispatch.wide_ep``)
            return base
        layout = {"ep": ep} | ({"all_to_all": False} if gathered else {})
        if (cached := self._scaled.get((*key, ep, gathered))) is None:  # the kernels with layout attributes
            cached = self._scaled[(*key, ep, gathered)] = [
                self.pricer(replace(k.op, attrs=k.op.attrs | layout), self.device)
                if isinstance(k, Priced) and "ep" in k.op.attrs
                else k
                for k in base
            ]
        return cached

    def memory(self, config: Config) -> Memory:
        """Per-device memory as ``simulate`` sizes it (planner formulas; weight lines built once)."""
        s, par = self.s, config.parallel
        dep = self.deployment(par, config.batch)
        lines = self._lines.get(config.quant)
        if lines is None:
            lines = self._lines[config.quant] = weight_lines(self.inputs[config.quant], Parallel())
        sequence = self._kv.get(par.tp)
        if sequence is None:
            kv = kv_sizing(s, par.tp, dep.kv_dtype, value_once=True)  # a serving runtime's cache
            tokens = self.kv_tokens or dep.context_len + dep.tokens_per_query
            sequence = self._kv[par.tp] = kv.sequence_bytes(tokens)
        logits_tokens = dep.tokens_per_rank if dep.decode else dep.batch_per_rank
        return Memory(
            weights=sum(params_per_device(x.group, x.params, s, par) * x.bytes_per_param for x in lines),
            kv_cache=float(dep.batch_per_rank * sequence),
            activations=activation_bytes(s, par, dep.tokens_per_rank, logits_tokens),
            capacity=self.device.memory_bytes,
        )

    def evaluate(self, config: Config) -> Point:
        dep = self.deployment(config.parallel, config.batch)
        step = sum(k.total for k in self.kernels(config))
        return Point(
            config,
            step,
            dep.output_tokens / step / self.devices,
            dep.output_tokens / dep.batch / step,
            self.memory(config),
        )

    def simulation(self, config: Config) -> simulator.Simulation:
        """``config`` as the ``Simulation`` ``simulate`` returns (without its notes)."""
        dep = self.deployment(config.parallel, config.batch)
        kernels = tuple(self.kernels(config))
        label = self.inputs[config.quant].quant_label
        return simulator.Simulation(
            dep, self.device, label, kernels, self.memory(config), (), self.s.describe()
        )

    # --- the whole grid --------------------------------------------------------------------------
    def grid(self) -> list[Config]:
        """Every layout x weight mode x batch of the sweep, in report order."""
        pars = layouts(self.s, self.devices)
        return [Config(par, batch, quant) for par in pars for quant in self.quants for batch in self.batches]

    def run(self, configs: Sequence[Config] | None = None) -> SweepResult:
        """Price ``configs`` (default: the whole ``grid``); invalid deployments skipped, misfits kept
        (``fits``). A request-level search passes its own list: the layouts a serving framework can
        run, and prefill batches of whole requests per DP group."""
        with applied(self.spec, backend=BACKEND):  # one patch session for every trace of the sweep
            return self._run(self.grid() if configs is None else list(configs))

    def _run(self, configs: list[Config]) -> SweepResult:
        pars = tuple(dict.fromkeys(c.parallel for c in configs))
        result = SweepResult(self.devices, pars, self.quants, self.batches)
        for config in configs:
            par, batch = config.parallel, config.batch
            try:
                self.deployment(par, batch).check(self.s)  # what ``simulate`` would refuse
            except UsageError as exc:
                reason = "batch not divisible by DP" if batch % par.dp else str(exc)
                result.skipped[reason] = result.skipped.get(reason, 0) + 1
                continue
            try:
                result.points.append(self.evaluate(config))
            except KadaptError as exc:  # e.g. no interconnect level spans the group
                reason = f"{config.layout}: {exc}"
                result.skipped[reason] = result.skipped.get(reason, 0) + 1
        result.traces, result.trace_seconds, result.same_as = (
            self.traces,
            self.trace_seconds,
            dict(self.same_as),
        )
        result.fallbacks = {
            f"TP{tp} b{'=1' if at == 1 else '>=2'} {base or 'checkpoint'}": fam.reason
            for (tp, at, base), fam in self._families.items()
            if fam.entries is None
        }
        return result
