"""``kadapt apply SPEC``: apply the spec, build the model on meta, print the ledger, run a backend.

Extraction options are checked *before* anything is applied or built, so a bad size or an
unwritable output directory fails in a second, not after building a 1T-parameter model; a value
no run could use (size 0, extraction options with another backend) is a usage error (exit 2).
torch and transformers are imported inside the command only. Everything apply prints is progress,
so ``-q`` prints nothing unless it fails; ``-v`` adds the resolved spec path and stage timings.
The extraction goes through the extraction cache (``backends/extraction/job/cache.py``): a run whose
every input was extracted before writes the stored artifacts instead of tracing (``--no-cache``
extracts regardless). With ``--verify`` the run's files reach the output folder only once verify
passed (``job.held.Held``): files that failed it are never left there looking verified.
"""

from __future__ import annotations

import dataclasses
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import click

from ..errors import KadaptError, UsageError
from ..patching.selection import CHOICES
from .collector import collector_tuned, freeze
from .int_list import IntList
from .output import format_option, reporter, verbosity_options
from .source_options import source_options
from .spec_argument import spec_argument


def model_summary(spec: Any, model: Any, structure: Any) -> dict[str, Any]:
    """Class, parameter count (meta parameters count too), decoder layers, experts and structure."""
    from ..loading import submodule

    layers = None
    if "language_layers" in spec.module_paths:
        layers = len(submodule(model, spec, "language_layers"))
    return {
        "class": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": layers,
        "experts": structure.moe.num_experts if structure.moe else 0,
        "structure": structure.describe(),
    }


def report_extraction(out: Any, ledger: Any, extracted: Any, reach: dict[str, int]) -> None:
    """The ledger with what the export reached, the extraction summary and its notes."""
    missed = ledger.record_reach(reach, run="the export")
    out.info(ledger.render_table())
    out.info(extracted.render())
    for note in extracted.notes:  # storage the spec claims but the checkpoint lacks, graphs left out
        out.note(f"note: {note}")
    for entry in missed:
        out.note(
            f"note: patch {entry.id} ({entry.kind} {entry.target}) had no effect: no call during the "
            "export reached it for a module of this model"
        )


def verify_failure(report: Any, output_dir: Path) -> str:
    """The error of a failed ``--verify``: where the replay first departs, and that nothing was written."""
    where = f"; first departure: {report.first_departure}" if report.first_departure else ""
    return (
        f"verification failed: the saved IR does not match transformers{where}. Nothing was written to "
        f"{output_dir}: the unverified files were removed and the folder's previous contents are untouched"
    )


SIZE = click.IntRange(1, 1 << 24)  # tokens or sequences: 0 or a typo's 1e12 is a usage error


@click.command(name="apply")
@spec_argument()
@click.option("--backend", type=click.Choice(CHOICES), default="extraction", show_default=True)
@format_option
@click.option(
    "--device", default="meta", show_default=True, help="Device the model is built on (no weights)."
)
@source_options
@click.option("--output-dir", type=click.Path(path_type=Path), help="extraction: output folder.")
@click.option("--batch", type=SIZE, help="extraction: batch size (default: spec abi).")
@click.option("--prefill-len", type=SIZE, help="extraction: prefill length (default: spec abi).")
@click.option("--max-cache-len", type=SIZE, help="extraction: KV cache capacity (default: spec abi).")
@click.option(
    "--kv-layout",
    type=click.Choice(["heads", "latent", "expanded"]),
    help="extraction: KV cache layout (heads for MHA/GQA/MQA; latent or expanded for MLA).",
)
@click.option(
    "--mla-attention",
    type=click.Choice(["reexpand", "absorbed"]),
    help="extraction: MLA attention over the latent cache (absorbed: kv_b_proj absorbed, no re-expansion).",
)
@click.option(
    "--dynamic",
    "dynamic",
    multiple=True,
    type=click.Choice(["batch", "prefill_len"]),
    help="extraction: export this size as a dynamic dimension, 1 up to its value (repeatable; "
    "default: the spec's abi.dynamic).",
)
@click.option("--static", is_flag=True, help="extraction: fixed sizes only, ignoring the spec's abi.dynamic.")
@click.option(
    "--kv-cache",
    type=click.Choice(["contiguous", "paged"]),
    help="extraction: decode cache as per-row caches or a paged block pool with a block-table input "
    "(default: the spec's abi.kv_cache, else contiguous).",
)
@click.option(
    "--block-size", type=SIZE, help="extraction: positions per block of a paged cache (implies paged)."
)
@click.option(
    "--num-blocks",
    type=SIZE,
    help="extraction: blocks in each layer's paged pool, independent of batch and context (implies "
    "paged; default: the spec's abi.kv_cache.num_blocks, else batch x max_cache_len / block_size).",
)
@click.option(
    "--step-tokens",
    type=SIZE,
    help="extraction: also export the packed step graph (<prefix>_step_ir.json) taking this many tokens "
    "per call: prefill chunks, decode and speculative tokens of every request (implies paged; default: "
    "the spec's abi.step).",
)
@click.option(
    "--step-logits",
    type=SIZE,
    help="extraction: tokens per step call whose logits the step graph returns (default: abi.step.logits, "
    "else batch).",
)
@click.option(
    "--step-mtp/--no-step-mtp",
    default=None,
    help="extraction: also export the MTP draft graph (<prefix>_mtp_ir.json) of a model whose config has "
    "an MTP layer (DeepSeek-V3, GLM-4.5); the step graph then also returns its asked tokens' final hidden "
    "states (needs the step graph; default: abi.step.mtp).",
)
@click.option(
    "--step-aux-layers",
    type=IntList(0, "layer ids"),
    default=None,
    help="extraction: the step graph also returns its asked tokens' hidden states after these decoder "
    "layers, concatenated (comma-separated, increasing: an EAGLE-3 draft's features; default: "
    "abi.step.aux_layers).",
)
@click.option(
    "--verify", is_flag=True, help="extraction: check the saved IR on a tiny model against transformers."
)
@click.option(
    "--no-cache",
    is_flag=True,
    help="extraction: neither restore nor store the artifacts in the extraction cache "
    "($KADAPT_CACHE_DIR, default ~/.cache/kadapt/extraction).",
)
@click.option(
    "--without",
    "without",
    multiple=True,
    metavar="ID",
    help="Apply the spec without this shim, bridge or patch (repeatable): shows what an entry is for.",
)
@verbosity_options
@collector_tuned
def command(
    spec_path: Path,
    backend: str,
    fmt: str,
    device: str,
    trust_remote_code: bool,
    source_dir: Path | None,
    from_hub: bool,
    output_dir: Path | None,
    batch: int | None,
    prefill_len: int | None,
    max_cache_len: int | None,
    kv_layout: str | None,
    mla_attention: str | None,
    dynamic: tuple[str, ...],
    static: bool,
    kv_cache: str | None,
    block_size: int | None,
    num_blocks: int | None,
    step_tokens: int | None,
    step_logits: int | None,
    step_mtp: bool | None,
    step_aux_layers: tuple[int, ...] | None,
    verify: bool,
    no_cache: bool,
    without: tuple[str, ...],
) -> None:
    """Apply SPEC behind its gate, build the model and run the chosen backend.

    JSON (--format json): {"ledger": {"spec", "backend", "counts", "entries"}, "model": {"class",
    "parameters", "layers", "experts", "structure"}, "extraction": {...} (extraction backend),
    "verify": {"passed", ...} (with --verify; a failed check exits 1 after the document, and nothing is
    written: "extraction" then says "written": false)}. With --verify the files are held in a hidden
    folder until verify passes; a failed verify leaves the output folder as it was.

    \b
    Examples:
      kadapt apply kimi_k25
      kadapt apply specs/llama.yaml --output-dir out/llama --verify -v
      kadapt apply kimi_k25 --backend none --format json
      kadapt apply llama --dynamic prefill_len --dynamic batch --batch 8
      kadapt apply llama --batch 8 --kv-cache paged --block-size 16 --verify
      kadapt apply llama --batch 8 --num-blocks 512 --step-tokens 256
    """
    out = reporter(fmt)
    out.detail(f"spec: {spec_path.resolve()}")
    from . import signals_deferred

    with out.stage("import torch"), signals_deferred():
        import torch

        from ..loading import applied, load_model
        from ..patching.session import active_session
        from ..spec import load_spec
        from ..spec.requirements import check_requirements
        from ..structure.of_spec import structure_of_config

    try:
        torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise UsageError(f"--device {device!r} is not a torch device (e.g. meta, cpu): {exc}") from exc
    with out.stage("load spec"):
        spec = load_spec(spec_path)
        check_requirements(spec)  # before any folder or model: the spec's releases are not these
    for line in spec.deprecations:
        out.note(line)
    if without:
        try:
            spec = spec.without(without)
        except ValueError as exc:
            raise UsageError(str(exc)) from exc
    if dynamic and static:
        raise UsageError("--dynamic and --static contradict each other")
    extraction = opts = None
    if backend == "extraction":
        from ..backends import extraction

        opts = extraction.options_from_spec(
            spec,
            output_dir=output_dir,
            batch=batch,
            prefill_len=prefill_len,
            max_cache_len=max_cache_len,
            kv_layout=kv_layout,
            mla_attention=mla_attention,
            dynamic=() if static else (dynamic or None),
            kv_cache=kv_cache,
            block_size=block_size,
            num_blocks=num_blocks,
            step_tokens=step_tokens,
            step_logits=step_logits,
            step_mtp=step_mtp,
            step_aux_layers=step_aux_layers,
        )
    elif (
        verify
        or no_cache
        or dynamic
        or static
        or any(
            v is not None
            for v in (
                output_dir,
                batch,
                prefill_len,
                max_cache_len,
                kv_layout,
                mla_attention,
                kv_cache,
                block_size,
                num_blocks,
                step_tokens,
                step_logits,
                step_mtp,
                step_aux_layers,
            )
        )
    ):
        raise UsageError(
            "--output-dir/--batch/--prefill-len/--max-cache-len/--kv-layout/--mla-attention/--dynamic/"
            "--static/--kv-cache/--block-size/--num-blocks/--step-tokens/--step-logits/--step-mtp/"
            "--step-aux-layers/--verify/--no-cache need --backend extraction"
        )
    if opts is not None:
        from ..backends.extraction.job.forked import export_processes

        processes = export_processes()  # a bad KADAPT_EXPORT_PROCESSES fails here, before any work
        with out.stage("check transformers"):  # its internals, before a 1T-parameter model is built
            extraction.check_upstream(opts)
        from ..upstream import untested_release

        if (untested := untested_release()) is not None:
            out.note(f"note: {untested}")
    result: dict[str, Any] = {}
    source = {"trust_remote_code": trust_remote_code, "source_dir": source_dir, "from_hub": from_hub}
    report = held = None
    # apply --verify: the run's files are held out of the output folder until verify passes (job.held.Held)
    with ExitStack() as withheld:
        with ExitStack() as session_scope:
            with out.stage("apply patches"):
                ledger = session_scope.enter_context(applied(spec, backend=backend, **source))
            if extraction is None:  # with a run, the ledger is printed after it, with what was reached
                out.info(ledger.render_table())
            # the structure is checked against the spec before the (possibly 1T-parameter) model is built
            with out.stage("structure"):
                session = active_session(spec)
                assert session is not None
                structure = structure_of_config(spec, session.config)
                if opts is not None:
                    opts = extraction.bind_structure(opts, structure)
            out.info(f"structure: {structure.describe()}")
            out.info(f"building {spec.name} on {device} ...")
            with out.stage("build model"):
                model = load_model(spec, device=device)
                freeze()  # the imports and the model live until the end: no collection rescans them
            summary = model_summary(spec, model, structure)
            result.update(ledger=ledger.to_dict(), model=summary)
            experts = f", {summary['experts']} experts" if summary["experts"] else ""
            out.info(
                f"model {summary['class']}: {summary['parameters']:,} parameters on {device}, "
                f"{summary['layers']} layers{experts}"
            )
            if extraction is not None:
                if verify:  # the extraction imports the pipeline anyway
                    from ..backends.extraction.job.held import held_until_verified

                    held = withheld.enter_context(held_until_verified(opts.output_dir))
                with out.stage("extraction"):
                    extracted, reach = extraction.run_cached(
                        spec,
                        model,
                        opts if held is None else dataclasses.replace(opts, output_dir=held.folder),
                        session=session,
                        device=device,
                        use_cache=not no_cache,
                        processes=processes,
                        echo=out.info,
                    )
                if held is not None:  # said with the paths the files get once verified
                    extracted = extracted.moved_to(opts.output_dir)
                report_extraction(out, ledger, extracted, reach)
                result.update(ledger=ledger.to_dict(), extraction=extracted.to_dict())
        if extraction is not None and verify:
            with out.stage("verify"):
                report = extraction.verify(spec, opts, echo=out.info, processes=processes)
            result["verify"] = report.to_dict()
            if not out.json:  # failing checks are the finding: shown even with -q
                (out.info if report.passed else out.result)(report.render())
            assert held is not None
            if report.passed:
                held.commit(path.name for path in extracted.artifacts)
            else:
                result["extraction"]["written"] = False
        if out.json:
            out.document(result)
    if report is not None and not report.passed:
        raise KadaptError(verify_failure(report, opts.output_dir))
