"""Benchmark: extract every shipped spec's full-size model on meta, and compare.

Each spec (default: every ``specs/*.yaml`` but the remote-code one) runs each contender, each in its
own subprocess (so peak RSS is its own) from a cold interpreter; wall time covers everything a user
waits for: imports, building the full-size model on meta, both graphs, writing JSON.

- ``kadapt``: ``kadapt apply``'s path (load_model under applied + extraction ``run``, layer stitching);
  for a spec with ``abi.vision`` (kimi_k25) this is the main job, vision graph included.
- ``kadapt-full``: the same with stitching off (every layer traced), for reference.
- ``vision`` / ``vision-full``: only the vision graph (MoonViT encoder + projector at the spec's image
  ABI) of the full-size model, stitched (2 of 27 encoder layers traced) and with every layer traced;
  each child hashes the IR JSON it would write, so the report also says whether both are identical.
  Skipped for specs without ``abi.vision``.
- ``torch_ir``: ``torch_ir.extract_ir`` on kadapt's own ABI wrappers over the same applied model.
  pytorch-ir's ``IR.save`` cannot write dtype/device attributes (its defect 1), so its JSON size is
  measured on ``json.dumps(ir.to_dict(), indent=2, default=str)``, the text ``save`` would write.

- ``floor`` / ``cli`` / ``warm`` / ``verify``: whole processes measured from the outside (wall time
  and the process's own peak RSS from ``wait4``): the import floor (``import torch, transformers``
  and the family's modeling module, nothing of kadapt's), the main job exactly as a user runs it
  (``kadapt -q apply specs/<spec>.yaml``) with an empty extraction cache (``cli``: a first run, which
  extracts and stores) and again with the cache that run filled (``warm``: restored), and
  ``--verify --no-cache`` (extraction and the tiny-model check, nothing restored). Each spec gets its
  own cache directory. A first run traces and writes its graphs in two forked children (two CPUs):
  ``wait4`` reports the largest process's peak, not their sum (a child's pages are mostly its
  parent's, shared). So the report also prints the peak of the memory summed over the process and
  its children (PSS, proportional set size: a shared page counts once in the sum), sampled every
  50 ms from ``/proc`` (Linux; "-" elsewhere). The report prints both runs against the floor measured
  in the same run (difference and ratio) and ``--verify`` against the first run: issue 23's targets
  are the floor + 2 s, 120% of the floor's memory (peak RSS), and verify <= 2x apply.

Usage: ``python benchmarks/bench_extraction.py [--specs llama,kimi_k25] [--modes kadapt,torch_ir,vision]``.
Figures from pytorch-ir's own Kimi-K2.5 example (shared reference): 254 s, 1.8 GB, 41.5 MB per graph;
they are printed against the ``kimi_k25`` row only.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

START = time.perf_counter()
REPO = Path(__file__).resolve().parents[1]
SPECS = sorted(p.stem for p in (REPO / "specs").glob("*.yaml") if p.stem != "kimi_k25_remote")
MODES = ("kadapt", "kadapt-full", "torch_ir", "vision", "vision-full", "floor", "cli", "warm", "verify")
PROCESS_MODES = ("floor", "cli", "warm", "verify")  # measured as whole processes, as a user runs them
VISION_MODES = ("vision", "vision-full")
REFERENCE = {"seconds": 254.0, "peak_rss_mb": 1800.0, "json_mb_per_graph": 41.5}


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: kB


def child_kadapt(spec_name: str, output_dir: Path, stitch: bool) -> dict[str, Any]:
    import dataclasses

    import torch

    from kimi_adapter_core.backends.extraction import options_from_spec, run
    from kimi_adapter_core.loading import applied, load_model
    from kimi_adapter_core.spec import load_spec

    spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
    options = dataclasses.replace(options_from_spec(spec, output_dir=output_dir), stitch=stitch)
    with applied(spec, backend="extraction"):
        built = time.perf_counter()
        model = load_model(spec, device="meta", dtype=torch.bfloat16)
        built = time.perf_counter() - built
        summary = run(spec, model, options, echo=lambda line: print(line, file=sys.stderr))
    graphs = summary.to_dict()["graphs"]
    return {
        "build_seconds": built,
        "extract_seconds": summary.seconds,
        "steps": dict(summary.steps),
        "nodes": {kind: graphs[kind]["nodes"] for kind in graphs},
        "json_bytes": {kind: graphs[kind]["bytes"] for kind in graphs},
    }


def child_vision(spec_name: str, stitch: bool) -> dict[str, Any]:
    """The full-size vision graph alone, as ``run`` builds it, and the IR text it would write."""
    import dataclasses
    import math

    import torch

    from kimi_adapter_core.backends.extraction import options_from_spec
    from kimi_adapter_core.backends.extraction.ir import vision
    from kimi_adapter_core.checkpoint.weight_map import weight_map_document
    from kimi_adapter_core.loading import applied, load_model
    from kimi_adapter_core.spec import load_spec

    spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
    options = dataclasses.replace(options_from_spec(spec, output_dir=tempfile.gettempdir()), stitch=stitch)
    with applied(spec, backend="extraction"):
        model = load_model(spec, device="meta", dtype=torch.bfloat16)
        start = time.perf_counter()
        modules = vision.prepare(spec, model, options)
        graph = vision.build_vision_graph(
            modules, options, "cpu", echo=lambda line: print(line, file=sys.stderr)
        )
        seconds = time.perf_counter() - start
        digest = hashlib.sha256()
        size = 0
        weight_map = weight_map_document(
            spec, model, graph.weights, model_name=options.model_name, renames=options.weight_renames
        )
        for chunk in vision.vision_chunks(spec, modules, graph, options, "cpu", weight_map):
            data = chunk.encode()
            digest.update(data)
            size += len(data)
    return {
        "vision_seconds": seconds,
        "layers": len(modules.encoder.layers),
        "traced_layers": int(graph.notes.get("traced_layers", len(modules.encoder.layers))),
        "nodes": len(graph.nodes),
        "weights": len(graph.weights),
        "parameters": sum(math.prod(t.shape) for t in graph.weights.values()),
        "json_bytes": size,
        "sha256": digest.hexdigest(),
    }


def child_torch_ir(spec_name: str) -> dict[str, Any]:
    import torch
    import torch_ir

    from kimi_adapter_core import upstream
    from kimi_adapter_core.backends.extraction import bind_structure, options_from_spec
    from kimi_adapter_core.backends.extraction.runtime import abi as runtime
    from kimi_adapter_core.checkpoint.dtypes import cast_to_abi_dtype
    from kimi_adapter_core.loading import applied, load_model, submodule
    from kimi_adapter_core.spec import load_spec
    from kimi_adapter_core.structure.derive import derive_structure

    spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
    options = options_from_spec(spec, output_dir=tempfile.gettempdir())
    nodes, sizes, save_errors = {}, {}, {}
    with applied(spec, backend="extraction"):
        model = load_model(spec, device="meta", dtype=torch.bfloat16)
        language_model, lm_head = submodule(model, spec, "language_model"), submodule(model, spec, "lm_head")
        cast_to_abi_dtype(model, [language_model, lm_head], torch.bfloat16)
        config = language_model.config
        options = bind_structure(options, derive_structure(config, spec))
        dtype = torch.bfloat16
        graphs = {
            "prefill": (
                runtime.PrefillWrapper,
                runtime.prefill_inputs(batch=options.batch, prefill_len=options.prefill_len, dtype=dtype),
            ),
            "decode": (
                runtime.DecodeWrapper,
                runtime.decode_inputs(
                    options.kv_dims,
                    batch=options.batch,
                    position=options.prefill_len,
                    max_cache_len=options.max_cache_len,
                    num_layers=config.num_hidden_layers,
                    dtype=dtype,
                ),
            ),
        }
        for kind, (cls, inputs) in graphs.items():
            wrapper = cls.from_language_model(
                language_model,
                lm_head,
                kv_layout=options.kv_layout,
                cache_keyword=upstream.decoder_protocol(language_model).cache_keyword,
                windows=options.windows,
            )
            with torch.no_grad():
                ir = torch_ir.extract_ir(wrapper, inputs, strict=False)
            nodes[kind] = len(ir.nodes)
            sizes[kind] = len(json.dumps(ir.to_dict(), indent=2, default=str).encode())
            try:
                with tempfile.TemporaryDirectory() as tmp:
                    torch_ir.save_ir(ir, Path(tmp) / "ir.json")
            except Exception as exc:  # its defect 1: dtype attributes are not JSON serialisable
                save_errors[kind] = f"{type(exc).__name__}: {str(exc)[:80]}"
            del ir
    return {"nodes": nodes, "json_bytes": sizes, "save_errors": save_errors}


def has_vision(spec_name: str) -> bool:
    from kimi_adapter_core.spec import load_spec  # no torch: the parent stays light

    abi = load_spec(REPO / "specs" / f"{spec_name}.yaml").abi
    return abi is not None and abi.vision is not None


def floor_module(spec_name: str) -> str:
    """The family's transformers modeling module, which the import floor imports."""
    from transformers.models.auto.configuration_auto import model_type_to_module_name

    from kimi_adapter_core.spec import load_spec  # no torch: the parent stays light

    name = model_type_to_module_name(load_spec(REPO / "specs" / f"{spec_name}.yaml").gate.model_type)
    return f"transformers.models.{name}.modeling_{name}"


def run_process(spec_name: str, mode: str, output_dir: Path) -> dict[str, Any]:
    """Wall time and peak RSS of one whole process: the import floor, the main job (first run into an
    empty cache, or the run after it) or its --verify."""
    import shutil

    cache = output_dir.parent / "extraction-cache"  # one per spec: ``cli`` fills it, ``warm`` reads it
    if mode == "cli":
        shutil.rmtree(cache, ignore_errors=True)
    elif mode == "warm" and not cache.exists():  # not after ``cli``: a first run fills it, unmeasured
        run_process(spec_name, "cli", output_dir)
    env = {**os.environ, "KADAPT_CACHE_DIR": str(cache)}
    if mode == "floor":
        command = [sys.executable, "-c", f"import torch, transformers, {floor_module(spec_name)}"]
    else:
        spec = str(REPO / "specs" / f"{spec_name}.yaml")
        command = [
            sys.executable,
            "-m",
            "kimi_adapter_core",
            "-q",
            "apply",
            spec,
            "--output-dir",
            str(output_dir),
        ]
        command += ["--verify", "--no-cache"] if mode == "verify" else []
    print(f"[bench] {spec_name}: running {mode} ...", flush=True)
    start = time.perf_counter()
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    sampler = PssSampler(child.pid)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - start
    pss = sampler.stop()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(
            f"{spec_name} {mode} failed: {child.stderr.read().decode()[-2000:] if child.stderr else ''}"
        )
    return {"seconds": seconds, "peak_rss_mb": usage.ru_maxrss / 1024, "peak_pss_mb": pss}


class PssSampler:
    """The peak, over samples every 50 ms, of the PSS summed over ``pid`` and its descendants (MB);
    None where ``/proc`` has no ``smaps_rollup``."""

    def __init__(self, pid: int) -> None:
        import threading

        self.pid, self.peak, self.done = pid, 0, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def stop(self) -> float | None:
        self.done.set()
        self.thread.join()
        return self.peak / 1024 if self.peak else None

    def _run(self) -> None:
        while not self.done.wait(0.05):
            self.peak = max(self.peak, sum(_pss_kb(pid) for pid in _tree(self.pid)))


def _tree(pid: int) -> list[int]:
    pids = [pid]
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children") as children:
                for child in children.read().split():
                    pids += _tree(int(child))
    except OSError:  # ended meanwhile
        pass
    return pids


def _pss_kb(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as rollup:
            return next((int(line.split()[1]) for line in rollup if line.startswith("Pss:")), 0)
    except OSError:
        return 0


def run_child(spec_name: str, mode: str, output_dir: Path) -> dict[str, Any]:
    command = [
        sys.executable,
        __file__,
        "--child",
        mode,
        "--spec",
        spec_name,
        "--output-dir",
        str(output_dir),
    ]
    print(f"[bench] {spec_name}: running {mode} ...", flush=True)
    start = time.perf_counter()
    done = subprocess.run(command, check=True, capture_output=True, text=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["seconds"] = time.perf_counter() - start  # from the parent: interpreter start to exit
    return result


def _ratio(reference: float, ours: float) -> str:
    return f"{reference / ours:5.1f}x" if ours else "-"


def _row(label: str, seconds: float, rss: float, nodes: dict[str, int], mb: dict[str, float]) -> str:
    return (
        f"{label:<24} {seconds:>7.1f} {rss:>11.0f} {nodes['prefill']:>13,} {nodes['decode']:>12,} "
        f"{mb['prefill']:>10.1f} {mb['decode']:>9.1f}"
    )


def vision_report(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The vision-graph table, stitched vs every layer traced, and their ratios (same run)."""
    lines = [
        "",
        f"{'vision graph (full size)':<24} {'wall s':>7} {'vision s':>8} {'peak RSS MB':>11} {'layers':>9} "
        f"{'nodes':>7} {'weights':>7} {'params':>8} {'JSON MB':>7}",
    ]
    for spec_name, modes in results.items():
        for mode in VISION_MODES:
            r = modes.get(mode)
            if r is None:
                continue
            lines.append(
                f"{spec_name + ' / ' + mode:<24} {r['seconds']:>7.1f} {r['vision_seconds']:>8.2f} "
                f"{r['peak_rss_mb']:>11.0f} {r['traced_layers']:>3}/{r['layers']:<3}  {r['nodes']:>7,} "
                f"{r['weights']:>7,} {r['parameters'] / 1e9:>7.3f}B {r['json_bytes'] / 1e6:>7.2f}"
            )
        ours, full = modes.get("vision"), modes.get("vision-full")
        if ours is not None and full is not None:
            same = "identical" if ours["sha256"] == full["sha256"] else "DIFFERENT"
            lines.append(
                f"  {spec_name} vision stitched vs every layer traced (same run): vision graph "
                f"{_ratio(full['vision_seconds'], ours['vision_seconds'])} faster, wall "
                f"{_ratio(full['seconds'], ours['seconds'])} faster, peak RSS "
                f"{ours['peak_rss_mb'] / full['peak_rss_mb']:.0%}; IR JSON {same} "
                f"({ours['nodes']:,} vs {full['nodes']:,} nodes)"
            )
        main = modes.get("kadapt")
        vision_step = (main or {}).get("steps", {}).get("export vision")
        if main is not None and vision_step is not None:
            lines.append(
                f"  {spec_name} main job (kadapt apply's path, vision included): wall "
                f"{main['seconds']:.1f} s, extraction {main['extract_seconds']:.1f} s, of which vision "
                f"{vision_step:.1f} s"
            )
    return lines


def floor_report(results: dict[str, dict[str, dict[str, Any]]]) -> list[str]:
    """The main job and --verify against the import floor measured in the same run."""
    lines = [
        "",
        f"{'main job vs import floor':<24} {'floor s':>7} {'apply s':>7} {'diff s':>6} {'ratio':>5} "
        f"{'floor MB':>8} {'apply MB':>8} {'mem':>5} {'PSS sum MB':>10} {'vs floor':>8} {'verify s':>8} "
        f"{'v/apply':>7}",
    ]
    for spec_name, modes in results.items():
        floor, cli, check = modes.get("floor"), modes.get("cli"), modes.get("verify")
        if floor is None:
            continue
        for label, run in (("first run", cli), ("cached", modes.get("warm"))):
            if run is None:
                continue
            verify = ""
            if check and run is cli:
                verify = f"{check['seconds']:>8.1f} {check['seconds'] / cli['seconds']:>6.1f}x"
            lines.append(
                f"{f'{spec_name} {label}':<24} {floor['seconds']:>7.1f} {run['seconds']:>7.1f} "
                f"{run['seconds'] - floor['seconds']:>+6.1f} {run['seconds'] / floor['seconds']:>4.1f}x "
                f"{floor['peak_rss_mb']:>8.0f} {run['peak_rss_mb']:>8.0f} "
                f"{run['peak_rss_mb'] / floor['peak_rss_mb']:>5.0%} {_pss(run, floor)} {verify}"
            )
    lines.append(
        "targets (issue 23): diff <= +2.0 s, mem <= 120%, v/apply <= 2x "
        "(first run: empty extraction cache; cached: the run after it; verify: --no-cache)"
    )
    return lines


def _pss(run: dict[str, Any], floor: dict[str, Any]) -> str:
    """The run's summed-PSS peak and its ratio to the floor's, or dashes where not sampled."""
    ours, theirs = run.get("peak_pss_mb"), floor.get("peak_pss_mb")
    if not ours or not theirs:
        return f"{'-':>10} {'-':>8}"
    return f"{ours:>10.0f} {ours / theirs:>8.0%}"


def report(results: dict[str, dict[str, dict[str, Any]]]) -> str:
    if all(mode in PROCESS_MODES for modes in results.values() for mode in modes):
        return "\n".join(floor_report(results))
    lines = [
        f"{'spec / contender':<24} {'wall s':>7} {'peak RSS MB':>11} {'prefill nodes':>13} "
        f"{'decode nodes':>12} {'prefill MB':>10} {'decode MB':>9}"
    ]
    for spec_name, modes in results.items():
        if spec_name == "kimi_k25":
            nodes, mb = {"prefill": 12342, "decode": 12403}, {"prefill": 41.5, "decode": 41.5}
            lines.append(
                _row("kimi_k25 / pytorch-ir*", REFERENCE["seconds"], REFERENCE["peak_rss_mb"], nodes, mb)
            )
        for mode, r in modes.items():
            if mode in VISION_MODES or mode in PROCESS_MODES:
                continue
            mb = {k: v / 1e6 for k, v in r["json_bytes"].items()}
            lines.append(_row(f"{spec_name} / {mode}", r["seconds"], r["peak_rss_mb"], r["nodes"], mb))
    if "kimi_k25" in results:
        lines.append("* pytorch-ir's own Kimi-K2.5 example, measured on this machine (reference document)")
    lines.append("")
    for spec_name, modes in results.items():
        ours = modes.get("kadapt")
        if ours is None:
            continue
        worst_mb = max(ours["json_bytes"].values()) / 1e6
        if "build_seconds" in ours:
            lines.append(
                f"{spec_name}: build on meta {ours['build_seconds']:.1f} s, extraction "
                f"{ours['extract_seconds']:.1f} s, imports/startup the rest"
            )
        if spec_name == "kimi_k25":
            lines.append(
                "  kadapt vs pytorch-ir reference: "
                f"wall {_ratio(REFERENCE['seconds'], ours['seconds'])} faster (target >= 10x, <= 25.4 s), "
                f"peak RSS {ours['peak_rss_mb'] / REFERENCE['peak_rss_mb']:.0%} (target <= 50%), "
                f"JSON {worst_mb / REFERENCE['json_mb_per_graph']:.0%} per graph (target <= 40%)"
            )
        theirs = modes.get("torch_ir")
        if theirs is not None:
            worst_theirs = max(theirs["json_bytes"].values()) / 1e6
            lines.append(
                "  kadapt vs torch_ir.extract_ir on kadapt's wrappers (same run): "
                f"wall {_ratio(theirs['seconds'], ours['seconds'])} faster, "
                f"peak RSS {ours['peak_rss_mb'] / theirs['peak_rss_mb']:.0%}, "
                f"JSON {worst_mb / worst_theirs:.0%}"
            )
            if theirs.get("save_errors"):
                lines.append(f"  torch_ir.save_ir failed: {next(iter(theirs['save_errors'].values()))}")
    if any(mode in VISION_MODES for modes in results.values() for mode in modes):
        lines += vision_report(results)
    if any("floor" in modes for modes in results.values()):
        lines += floor_report(results)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--specs", default=",".join(SPECS), help="comma list of shipped spec names")
    parser.add_argument(
        "--modes",
        default="kadapt,torch_ir,vision,vision-full",
        help=f"comma list of {', '.join(MODES)} (vision modes: specs with abi.vision only)",
    )
    parser.add_argument(
        "--output-dir", type=Path, default=None, help="where kadapt writes (default: a temp dir)"
    )
    parser.add_argument("--json", action="store_true", help="print the raw results as JSON too")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--spec", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        if args.child == "torch_ir":
            result = child_torch_ir(args.spec)
        elif args.child in VISION_MODES:
            result = child_vision(args.spec, stitch=args.child == "vision")
        else:
            result = child_kadapt(args.spec, args.output_dir, stitch=args.child == "kadapt")
        result.update(child_seconds=time.perf_counter() - START, peak_rss_mb=_peak_rss_mb())
        print(json.dumps(result))
        return
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        parser.error(f"unknown modes {', '.join(unknown)}; choose from {', '.join(MODES)}")
    results: dict[str, dict[str, dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="kadapt-bench-") as tmp:
        out = args.output_dir or Path(tmp)
        for spec_name in args.specs.split(","):
            runnable = [m for m in modes if m not in VISION_MODES or has_vision(spec_name)]
            results[spec_name] = {
                mode: (run_process if mode in PROCESS_MODES else run_child)(
                    spec_name, mode, out / spec_name / mode
                )
                for mode in runnable
            }
    print(report(results))
    if args.json:
        print(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
