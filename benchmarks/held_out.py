"""The held-out experiment: kernel tables scored on cells they never saw, on a development split that
rules are chosen on and a test split scored once per change of the rules.

Run: ``python benchmarks/held_out.py`` (the development split, ~1 min; needs the ``measured`` extra)
or ``python benchmarks/held_out.py --score-test`` (also the test split, recorded in
``held_out_ledger.json``); ``bench_simulation.py --held-out-only`` runs the first.

[HELD-OUT] Kernel tables as a leave-out experiment within each serving framework, scored against
AIConfigurator's own step estimate computed in the same run (its engine, ``EngineHandle.compile`` +
``predict_*_latency``). kadapt always prices with the framework's own table (``--framework``), so
every (device, framework) it ships - h100_sxm, h200_sxm, b200_sxm, gb200 x TensorRT-LLM, SGLang,
vLLM - is a cell, priced with its shipped table and with tables that never saw that cell's own rows:
"shapes" (the cell's table refitted without any row of the family's width or per-rank head counts,
``without_shapes``), "layout" (refitted without the scored layout's rows: every model's expert rows at
its EP size, the attention and MLA rows at its per-rank head count, ``without_layout``), "device" (the
framework's table measured on the same GPU generation: H100 <-> H200, B200 <-> GB200, priced on the
scored device as a borrowed table is) and "other gen" (the same from the other generation; printed,
not in the pass score). Families DeepSeek-V3 (fp8 block), Qwen3-235B-A22B and Llama-3.1-8B (bf16),
Kimi-K2.5 as shipped (int4 experts: AIConfigurator has no TensorRT-LLM int4 MoE, so it is scored on
SGLang and vLLM only), each at two layouts; decode batch 1/32/128 at context 4096, prefill 1 x 1024
and 1 x 4096.

Honest scoring, two rules:
- **Not scorable.** A case a refit ("shapes", "layout") prices is not scorable when the shipped
  table prices some op from a measurement (framework, version, kernel) of which the refit kept no row:
  the refit then prices it from another kernel - an older release, another dtype - or the roofline,
  which says nothing of how the table's rules carry over (Kimi-K2.5's int4 experts: the newest SGLang
  and vLLM measured them at its width only, so the "shapes" refit prices them from SGLang 0.5.10's
  ~4.7x slower Marlin). Such a case is counted apart, with the kernel named (``unscorable``). A
  borrowed table ("device") is scored as it prices: that is what a device without its own table gets.
- **Development and test split** (``DEVELOPMENT`` / ``TEST``, data). Rules (how curves are fitted,
  interpolated and extrapolated) are chosen looking at the development split only. The test split has
  other devices, other model widths and attention kinds, and other layouts and EP sizes
  (``tests/test_calibration.py`` checks they are disjoint); serving frameworks are in both, since each
  framework's table prices only that framework. Cells that share a device, family or layout with each
  split are "crossed": printed with the test split, in neither score. The test split is printed only
  with ``--score-test``, and its score is recorded in ``held_out_ledger.json`` under a fingerprint of
  the rules' source (``rules_fingerprint``): scoring it again under the same rules prints the first
  record beside the rerun, so how often the test split was looked at is on record.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.metadata
import json
import re
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import yaml

from kimi_adapter_core.atomic import atomic_write_text
from kimi_adapter_core.backends.simulation.estimate import aiconfigurator
from kimi_adapter_core.backends.simulation.estimate.cost import Priced, kernel_table, price
from kimi_adapter_core.backends.simulation.estimate.simulator import finish_step, trace_kernels
from kimi_adapter_core.backends.simulation.model.deployment import Deployment
from kimi_adapter_core.backends.simulation.model.inputs import model_inputs
from kimi_adapter_core.backends.simulation.model.parallel import Parallel
from kimi_adapter_core.backends.simulation.model.tracer import Op
from kimi_adapter_core.backends.simulation.tables import calibrate, calibrate_rows
from kimi_adapter_core.backends.simulation.tables.device import Device, get_device
from kimi_adapter_core.backends.simulation.tables.kernels import KernelTable, parse_kernels
from kimi_adapter_core.spec import load_spec

REPO = Path(__file__).resolve().parents[1]
LEDGER = Path(__file__).resolve().parent / "held_out_ledger.json"
# the source of the rules a held-out table prices with: fitting (calibrate*), curves and their
# lookup across shapes (curves, kernels), which per-shape curves are plausible (plausible), and pricing
# an op from them (cost)
RULES = (
    "kimi_adapter_core/backends/simulation/estimate/cost.py",
    "kimi_adapter_core/backends/simulation/tables/curves.py",
    "kimi_adapter_core/backends/simulation/tables/kernels.py",
    "kimi_adapter_core/backends/simulation/tables/plausible.py",
    "kimi_adapter_core/backends/simulation/tables/calibrate*.py",
)
# a curve's source: "<device>/<op>/<framework>/<version>/<file> (<kernel>)..." -> its measurement
MEASUREMENT = re.compile(r"^[^/\s]+/[^/\s]+/([^/\s]+)/([^/\s]+)/\S+ \(([^)]+)\)")
WITHIN, FAR = 0.15, 0.35  # the pass band, and the band no scorable test case may leave


@dataclass(frozen=True)
class Family:
    spec: str  # kadapt spec file stem
    model: str  # AIConfigurator's model name
    layouts: tuple[tuple[int, int], ...]  # (tp, ep)
    kv_dtype: str
    quant: dict[str, str]  # AIConfigurator quant overrides
    hidden: int  # model width: the "shapes" fit drops every measured row of this width
    heads: int  # query heads: ... and every attention row with as many heads per rank as a layout's

    def heads_per_rank(self, tp: int) -> int:
        return self.heads // tp


FAMILIES = [
    Family(
        "deepseek_v3",
        "deepseek-ai/DeepSeek-V3",
        ((8, 8), (4, 4)),
        "fp8",
        {"fmha_quant_mode": "bfloat16"},
        7168,
        128,
    ),
    Family("qwen3_moe", "Qwen/Qwen3-235B-A22B", ((8, 8), (4, 4)), "bf16", {}, 4096, 64),
    Family("llama", "meta-llama/Meta-Llama-3.1-8B", ((1, 1), (2, 1)), "bf16", {}, 4096, 32),
    Family("kimi_k25", "moonshotai/Kimi-K2.5", ((8, 8), (4, 4)), "bf16", {}, 7168, 64),
]
# (label, decode, batch, new tokens per query, context)
POINTS = [
    ("decode b1", True, 1, 1, 4096),
    ("decode b32", True, 32, 1, 4096),
    ("decode b128", True, 128, 1, 4096),
    ("prefill 1024", False, 1, 1024, 0),
    ("prefill 4096", False, 1, 4096, 0),
]
# every (AIConfigurator system, framework) scored: each is priced with its framework's own table, as
# ``kadapt simulate --framework`` prices, fitted without that cell's own measurements
TARGETS = [(system, framework) for system in calibrate.SYSTEMS for framework in calibrate_rows.FRAMEWORKS]
# the device a "device" held-out table was measured on: the same GPU generation (H100 and H200 are
# one Hopper die with different HBM; B200 and GB200 one Blackwell die, GB200 on a Grace board) ...
SAME_GENERATION = {"h100_sxm": "h200_sxm", "h200_sxm": "h100_sxm", "b200_sxm": "gb200", "gb200": "b200_sxm"}
# ... and the other generation (Hopper from B200, Blackwell from H200), its own column
OTHER_GENERATION = {
    "h100_sxm": "b200_sxm",
    "h200_sxm": "b200_sxm",
    "b200_sxm": "h200_sxm",
    "gb200": "h200_sxm",
}
# informational, not in the score: (system, framework scored, framework whose table prices it). A
# table prices its own framework's kernels; SGLang's Triton MoE or vLLM's MLA module are other kernels
CROSS_FRAMEWORK = [
    ("h200_sxm", "sglang", "trtllm"),
    ("h200_sxm", "vllm", "trtllm"),
    ("h200_sxm", "trtllm", "sglang"),
]
KINDS = ("shipped", "shapes", "layout", "device", "other gen")  # columns; all but "shipped" held out
SCORED = ("shapes", "layout", "device")  # the pass score: within 15% in every case of these


def _table(data: dict[str, Any], label: str) -> KernelTable:
    """A kernel table built in memory from ``calibrate``'s output, as ``load_kernels`` would."""
    return parse_kernels(json.loads(json.dumps(data)), Path(f"<{label}>"))


def without_shapes(family: Family) -> calibrate_rows.RowFilter:
    """A row filter dropping every measured row of the family's own shapes: its width (GEMM N or K,
    MoE hidden size) and its per-rank head count at any of its layouts (attention, MLA kernels and
    modules), so every kernel shape of the family is out of sample."""
    heads = [family.heads_per_rank(tp) for tp, _ in family.layouts]

    def keep(op: str, rows: Any) -> Any:
        if op == "gemm":
            return rows[(rows.n != family.hidden) & (rows.k != family.hidden)]
        if op == "moe":
            return rows[rows.hidden_size != family.hidden]
        return rows[~rows.num_heads.isin(heads)]

    return keep


def without_layout(family: Family, tp: int, ep: int) -> calibrate_rows.RowFilter:
    """A row filter dropping every measured row of the scored layout's split, whatever the model: the
    expert rows at its EP size and the attention rows (MLA kernels and modules too) at its per-rank
    head count. GEMM rows stay (their curves are medians by M over every shape, with no layout)."""
    heads = family.heads_per_rank(tp)

    def keep(op: str, rows: Any) -> Any:
        if op == "moe":
            return rows[rows.moe_ep_size != ep]
        if op in ("attention", "mla"):
            return rows[rows.num_heads != heads]
        return rows

    return keep


class Refit(NamedTuple):
    document: dict[str, Any]  # calibrate's output: each curve names the measurement it was fitted on
    table: KernelTable


def held_out_fit(system: str, framework: str, row_filter: calibrate_rows.RowFilter, label: str) -> Refit:
    """``framework``'s table on ``system`` refitted on the rows ``row_filter`` keeps: the filters drop
    every row of the shapes scored, so no curve of those shapes is left; the curves of the other
    shapes price them from the EP sizes, model widths and head counts around them, as in a shipped table
    (``tests/test_calibration.py`` checks that no curve of a scored shape is left)."""
    document = calibrate.calibrate(system, framework, row_filter)
    return Refit(document, _table(document, label))


def source_table(system: str, framework: str) -> KernelTable:
    """The shipped table of ``framework`` measured on ``system`` (a regeneration of its rows)."""
    return kernel_table(get_device(calibrate.SYSTEMS[system]), framework)


class AicSteps:
    """AIConfigurator's step estimates, one compiled engine per model, system, framework and layout."""

    def __init__(self) -> None:
        self.engine = aiconfigurator.require()
        self.handles: dict[tuple[str, str, str, int, int], Any] = {}

    def step_ms(
        self, family: Family, system: str, framework: str, tp: int, ep: int, point: tuple
    ) -> float | str:
        _, decode, batch, tokens, context = point
        key = (family.model, system, framework, tp, ep)
        try:
            if key not in self.handles:
                self.handles[key] = self.engine.EngineHandle.compile(
                    family.model,
                    system,
                    framework,
                    tp_size=tp,
                    attention_dp_size=1,
                    moe_tp_size=1,
                    moe_ep_size=ep,
                    **family.quant,
                )
            handle = self.handles[key]
            return (
                handle.predict_decode_latency(batch, context, 2)
                if decode
                else handle.predict_prefill_latency(batch, tokens)
            )
        except Exception as exc:  # AIConfigurator's own errors (a kernel it never measured)  # noqa: BLE001
            return str(exc).split(":")[0][:60]


def _spread(ratios: list[float]) -> str:
    if not ratios:
        return f"{'n/a':>17}"
    return f"{min(ratios):5.2f} {statistics.median(ratios):5.2f} {max(ratios):5.2f}"


Traced = dict[tuple[str, int, int, str], tuple[list[Op], Deployment]]


def _trace_all() -> Traced:
    """Every family's kernels at each layout and point, traced once (pricing is per table)."""
    traced: Traced = {}
    for family in FAMILIES:
        spec = load_spec(REPO / "specs" / f"{family.spec}.yaml")
        inputs = model_inputs(spec, None)
        for tp, ep in family.layouts:
            for label, decode, batch, tokens, context in POINTS:
                dep = Deployment(
                    Parallel(tp, 1, ep), batch, tokens, context, decode, kv_dtype=family.kv_dtype
                )
                traced[(family.spec, tp, ep, label)] = (trace_kernels(spec, inputs, dep)[0], dep)
    return traced


@dataclass(frozen=True)
class Split:
    """A set of held-out cells: a cell is in it when its device, family and layout all are."""

    devices: tuple[str, ...]
    families: tuple[str, ...]
    layouts: tuple[tuple[int, int], ...]  # (tp, ep)

    def holds(self, system: str, family: str, layout: tuple[int, int]) -> bool:
        return system in self.devices and family in self.families and layout in self.layouts


# Declared 2026-11-30. Development: the MLA MoE families (width 7168, EP8) on H200 and B200. Test: the
# GQA families (width 4096; dense and MoE) at TP4 EP4, TP1 and TP2 on H100 and GB200.
DEVELOPMENT = Split(("h200_sxm", "b200_sxm"), ("deepseek_v3", "kimi_k25"), ((8, 8),))
TEST = Split(("h100_sxm", "gb200"), ("qwen3_moe", "llama"), ((4, 4), (1, 1), (2, 1)))
SPLITS = ("development", "test", "crossed")


def split_of(system: str, family: str, layout: tuple[int, int]) -> str:
    """``development``, ``test``, or ``crossed`` (shares a device, family or layout with each)."""
    if DEVELOPMENT.holds(system, family, layout):
        return "development"
    if TEST.holds(system, family, layout):
        return "test"
    return "crossed"


def measurement(document: dict[str, Any], op: Op) -> str | None:
    """The measurement (framework, version and kernel) of the curve that prices ``op`` in a kernel
    table document, found as ``KernelTable`` finds it (a dtype not measured falls back to the
    nearest); None for an op no curve prices (vector ops, communication)."""
    if op.kind in ("matmul", "experts"):
        curves = document.get("gemm" if op.kind == "matmul" else "grouped_gemm") or {}
        curve = KernelTable._pick(curves, str(op.attrs.get("kernel", op.compute)))
    elif op.kind == "attention" and "kernel" in op.attrs:
        phase = "decode" if op.attrs["decode"] else "prefill"
        curve = ((document.get("attention") or {}).get(phase) or {}).get(op.attrs["kernel"])
    else:
        return None
    found = MEASUREMENT.match(curve["source"]) if curve else None
    return " ".join(found.groups()) if found else "no curve (the roofline)"


def unscorable(shipped: dict[str, Any], held: dict[str, Any], ops: list[Op]) -> str | None:
    """Why a case a refit prices cannot be scored, or None: the first op whose curve in the shipped
    table ``shipped`` was fitted on a measurement (framework, version, kernel) of which the refit
    ``held`` kept no row, so the refit prices it from another kernel (an older release, another
    dtype) or the roofline, and the case says nothing of how the rules carry over."""
    for op in ops:
        ours = measurement(shipped, op)
        if ours is not None and ours != (theirs := measurement(held, op)):
            return f"{op.kind} {op.attrs.get('kernel', op.compute)}: no {ours} row left ({theirs} instead)"
    return None


def rules_fingerprint() -> str:
    """A digest of the rules' source files and the AIConfigurator version they fit on."""
    digest = hashlib.sha256(importlib.metadata.version("aiconfigurator-core").encode())
    for pattern in RULES:
        for path in sorted(REPO.glob(pattern)):
            digest.update(path.relative_to(REPO).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()[:16]


@dataclass
class Tally:
    """One split's and kind's held-out cases: the scorable ratios and the unscorable reasons."""

    ratios: list[float] = field(default_factory=list)
    unscorable: dict[str, int] = field(default_factory=dict)

    def add(self, ratio: float, reason: str | None) -> None:
        if reason is None:
            self.ratios.append(ratio)
        else:
            self.unscorable[reason] = self.unscorable.get(reason, 0) + 1

    def record(self) -> dict[str, Any]:
        """The ledger's form: counts, and the not-scorable cases by reason."""
        return {
            "scorable": len(self.ratios),
            "within_15": sum(abs(r - 1) <= WITHIN for r in self.ratios),
            "outside_35": sum(abs(r - 1) > FAR for r in self.ratios),
            "not_scorable": dict(sorted(self.unscorable.items())),
        }


def summary(kind: str, record: dict[str, Any]) -> str:
    """One line of a split's score for ``kind``."""
    n, within, far = record["scorable"], record["within_15"], record["outside_35"]
    share = f"{within / n:.1%}" if n else "n/a"
    apart = sum(record["not_scorable"].values())
    why = "; ".join(f"{count} {reason}" for reason, count in record["not_scorable"].items())
    line = f"    {kind + ':':10} {within}/{n} scorable within 15% ({share}), {far} outside 35%"
    return line + (f"; {apart} not scorable ({why})" if apart else "")


def read_ledger() -> list[dict[str, Any]]:
    return json.loads(LEDGER.read_text()) if LEDGER.exists() else []


def ledger_entry(ledger: list[dict[str, Any]], fingerprint: str) -> dict[str, Any] | None:
    """The test score recorded under ``fingerprint``, if these rules were scored before."""
    return next((entry for entry in ledger if entry["rules"] == fingerprint), None)


def record_test(fingerprint: str, scores: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """Append the test split's score under ``fingerprint`` unless these rules were scored before;
    return the earlier record, if any (a rerun is not a new test)."""
    ledger = read_ledger()
    earlier = ledger_entry(ledger, fingerprint)
    if earlier is None:
        entry = {"rules": fingerprint, "date": datetime.date.today().isoformat(), "test": scores}
        atomic_write_text(LEDGER, json.dumps([*ledger, entry], indent=1) + "\n")
    return earlier


def _priced(ops: list[Op], device: Device, table: KernelTable | None) -> list[Priced]:
    return [price(op, device, table) for op in ops]


def _step(priced: list[Priced], dep: Deployment) -> float:
    return sum(k.total for k in finish_step(priced, dep)) * 1e3


Cell = tuple[str, str, str, str]  # (system, framework, family, phase)


def held_out_table(score_test: bool = False) -> None:
    """min / median / max of kadapt / AIConfigurator per cell, family and phase, with the shipped table
    and each held-out table of the cell's framework; then each split's score. The test split and the
    crossed cells only with ``score_test`` (see the module docstring)."""
    if not aiconfigurator.available():
        print("\nheld-out accuracy: needs aiconfigurator-core (pip install 'kadapt[measured]')")
        return
    shown = SPLITS if score_test else ("development",)
    aic = AicSteps()
    traced = _trace_all()
    ratios: dict[Cell, dict[str, list[float]]] = {}
    tallies = {(split, kind): Tally() for split in SPLITS for kind in KINDS}
    missing: dict[tuple[str, str, str], str] = {}
    outside: list[str] = []  # the shipped cases outside 15%, named (a spread hides which)
    for system, framework in TARGETS:
        device = get_device(calibrate.SYSTEMS[system])
        shipped = kernel_table(device, framework)
        assert shipped is not None
        shipped_document = yaml.safe_load(shipped.path.read_text())
        moved = {
            "device": source_table(SAME_GENERATION[system], framework),
            "other gen": source_table(OTHER_GENERATION[system], framework),
        }
        for family in FAMILIES:
            layouts = [lay for lay in family.layouts if split_of(system, family.spec, lay) in shown]
            if not layouts:
                continue
            refs = {
                (tp, ep, point[0]): aic.step_ms(family, system, framework, tp, ep, point)
                for tp, ep in layouts
                for point in POINTS
            }
            failed = [ref for ref in refs.values() if isinstance(ref, str)]
            if failed:
                missing[(system, framework, family.spec)] = failed[0]
                continue
            refits = {
                "shapes": held_out_fit(
                    system, framework, without_shapes(family), "without the family's shapes"
                )
            }
            for tp, ep in layouts:
                split = split_of(system, family.spec, (tp, ep))
                refits["layout"] = held_out_fit(
                    system, framework, without_layout(family, tp, ep), f"without TP{tp} EP{ep}"
                )
                tables = {
                    "shipped": shipped,
                    **moved,
                    **{kind: refit.table for kind, refit in refits.items()},
                }
                for label, decode, *_ in POINTS:
                    ops, dep = traced[(family.spec, tp, ep, label)]
                    ref = refs[(tp, ep, label)]
                    assert isinstance(ref, float)
                    got = ratios.setdefault(
                        (system, framework, family.spec, "decode" if decode else "prefill"), {}
                    )
                    in_sample = _priced(ops, device, shipped)
                    for kind in KINDS:
                        priced = in_sample if kind == "shipped" else _priced(ops, device, tables[kind])
                        ratio = _step(priced, dep) / ref
                        got.setdefault(kind, []).append(ratio)
                        refit = refits.get(kind)
                        why = refit and unscorable(shipped_document, refit.document, ops)
                        tallies[(split, kind)].add(ratio, why or None)
                        if kind == "shipped" and abs(ratio - 1) > WITHIN:
                            outside.append(
                                f"{system}/{framework} {family.spec} TP{tp} EP{ep} {label}: {ratio:.3f}"
                            )
    _print_cells(ratios, missing, shown)
    for case in outside:
        print(f"    shipped tables, outside 15%: {case}")
    _print_scores(tallies, score_test)
    cross_framework_table(aic, traced)


def _print_cells(
    ratios: dict[Cell, dict[str, list[float]]], missing: dict[tuple[str, str, str], str], shown: tuple
) -> None:
    print()
    print(
        "Held-out accuracy [HELD-OUT]: kadapt / AIConfigurator (computed live), min median max over "
        "the cell's layouts x decode b1/b32/b128 at 4k, prefill 1k / 4k; every cell priced with its "
        "framework's table: shipped, and fitted without the cell's own rows (held out):"
    )
    print("    shapes: the cell's table refitted without any row of the family's width or per-rank heads")
    print("    layout: ... without the scored layout's rows (experts at its EP, attention at its heads/rank)")
    same = ", ".join(f"{t.split('_')[0]}<-{s.split('_')[0]}" for t, s in SAME_GENERATION.items())
    other = ", ".join(f"{t.split('_')[0]}<-{s.split('_')[0]}" for t, s in OTHER_GENERATION.items())
    print(f"    device: the framework's table measured on the same GPU generation ({same})")
    print(f"    other gen: ... on the other generation ({other}); not in the pass score")
    print(f"    splits shown: {', '.join(shown)}")
    print(f"{'cell':16} {'family':12} {'phase':8} {'n':>3} " + " ".join(f"{k:>17}" for k in KINDS))
    for system, framework in TARGETS:
        for family in FAMILIES:
            where = f"{system}/{framework}"
            if (system, framework, family.spec) in missing:
                reason = missing[(system, framework, family.spec)]
                print(f"{where:16} {family.spec:12} {'':8} {'':>3} AIConfigurator: {reason}")
                continue
            for phase in ("decode", "prefill"):
                got = ratios.get((system, framework, family.spec, phase))
                if got:
                    print(
                        f"{where:16} {family.spec:12} {phase:8} {len(got['shipped']):3} "
                        + " ".join(_spread(got[k]) for k in KINDS)
                    )


def _print_scores(tallies: dict[tuple[str, str], Tally], score_test: bool) -> None:
    """Each split's score per held-out kind; the test split's against the ledger."""
    fingerprint = rules_fingerprint()
    print(f"Scores (rules {fingerprint}; scored kinds: {', '.join(SCORED)}; 'other gen' printed only):")
    for split in SPLITS if score_test else ("development",):
        print(f"  {split}{' (in neither score)' if split == 'crossed' else ''}:")
        for kind in KINDS:
            print(summary(kind, tallies[(split, kind)].record()))
    test = {kind: tallies[("test", kind)].record() for kind in SCORED}
    if score_test:
        earlier = record_test(fingerprint, test)
        total = _pooled(test)
        print(
            f"  test split, scored kinds pooled: {total['within_15']}/{total['scorable']} within 15%, "
            f"{total['outside_35']} outside 35% (target: >= 95% and none)"
        )
        if earlier is None:
            print(f"  recorded in {LEDGER.name} (first scoring under these rules)")
        else:
            print(f"  NOT a new test: these rules were scored on {earlier['date']} ({LEDGER.name}):")
            print(f"    then: {_pooled(earlier['test'])}")
        return
    earlier = ledger_entry(read_ledger(), fingerprint)
    if earlier is None:
        print("  test split: not scored under these rules yet (--score-test, once per change of the rules)")
    else:
        total = _pooled(earlier["test"])
        print(
            f"  test split, recorded {earlier['date']}: {total['within_15']}/{total['scorable']} within "
            f"15%, {total['outside_35']} outside 35%"
        )


def _pooled(records: dict[str, dict[str, Any]]) -> dict[str, int]:
    """The scored kinds' counts added up."""
    keys = ("scorable", "within_15", "outside_35")
    return {key: sum(records[kind][key] for kind in SCORED) for key in keys}


def cross_framework_table(aic: AicSteps, traced: Traced) -> None:
    """Informational: one framework's table pricing another framework's serving (not scored)."""
    print()
    print(
        "Across frameworks (informational, not in the pass score): a framework's table priced against "
        "another framework's serving, kadapt / AIConfigurator"
    )
    print(
        f"{'scored on':16} {'table':16} {'family':12} {'phase':8} {'n':>3} {'shipped':>17} "
        f"{'other framework':>17}"
    )
    for system, framework, source in CROSS_FRAMEWORK:
        device = get_device(calibrate.SYSTEMS[system])
        tables = (kernel_table(device, framework), kernel_table(device, source))
        for family in FAMILIES:
            got: dict[str, list[tuple[float, float]]] = {}
            for tp, ep in family.layouts:
                for point in POINTS:
                    ref = aic.step_ms(family, system, framework, tp, ep, point)
                    if isinstance(ref, str):
                        continue
                    ops, dep = traced[(family.spec, tp, ep, point[0])]
                    ratios = tuple(_step(_priced(ops, device, t), dep) / ref for t in tables)
                    got.setdefault("decode" if point[1] else "prefill", []).append(ratios)
            for phase, pairs in got.items():
                print(
                    f"{system + '/' + framework:16} {system + '/' + source:16} {family.spec:12} {phase:8} "
                    f"{len(pairs):3} {_spread([p[0] for p in pairs])} {_spread([p[1] for p in pairs])}"
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--score-test",
        action="store_true",
        help="also score the test split and the crossed cells (recorded once per change of the rules)",
    )
    held_out_table(parser.parse_args().score_test)


if __name__ == "__main__":
    main()
