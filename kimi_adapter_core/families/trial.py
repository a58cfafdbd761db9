"""One model type through the path a user takes: the spec ``docs/writing-a-spec.md`` describes, then
``validate --resolve``, ``apply`` (the extraction backend: every check before export, the export
itself) and ``--verify`` (float32: the saved files replayed against transformers' ``generate``).

The config is already small, so apply and verify share one extraction. Apply's checks run on the
spec's own model first (``extraction.check``: every refusal where apply raises it, nothing exported);
then verify's tiny random model is applied into the row's output folder (``verify(..., keep_in=)``,
the same checks again, then the export) and those files are what verify replays. Apply then verify
would export the same architecture twice: half of the matrix's time.

The spec is the guide's: gate and source, eager attention and ``batched_mm`` experts for export, and
``module_paths`` where the built model holds its decoder stack (the module with ``layers`` and an
``embed_tokens``, else the causal LM's base model), its LM head and, where the stack names them
otherwise, its embedding, final norm and rotary embedding. The config is the model type's
own defaults made small (``tiny``), so apply and verify run in seconds.

A row is ``adapted`` (apply wrote its files and verify passed), ``refused`` (a ``Refusal`` with its
documented code, or a moved contact point: raised before anything was written) or ``failed``
(anything else: an error kadapt did not classify, a traceback, a failed verify, files written by a
refused run). The matrix's promise is that no row fails. A type whose own default config does not
build a model in transformers (small or not), or whose trial fails where transformers' own model, built
unpatched from the same config, does not run its forward either, is ``untested``: there is nothing to
try it with, or to compare against.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import tempfile
import textwrap
import traceback
from pathlib import Path
from typing import Any, NamedTuple

from ..errors import KadaptError, parse_refusal
from .guide import GUIDE_FIELDS, GUIDE_LAYER_PATCHES, GUIDE_PATCHES

ADAPTED, REFUSED, FAILED, UNTESTED = "adapted", "refused", "failed", "untested"
PLAN_EXACT = "exact"


class Row(NamedTuple):
    model_type: str
    outcome: str  # adapted | refused | failed
    code: str  # the refusal code (refused), the error kind (failed), or "" (adapted)
    detail: str  # one line: what was refused or failed, or what was proven
    # adapted rows: whether plan's parameter inventory is the model transformers builds (``census``):
    # "exact", or "departs: " and how; "" for the other outcomes
    plan: str = ""


# words in the path of a stack's child that belongs to a vision tower, not to the decoder stack
TOWER_NAMES = ("vision", "image", "visual")


def module_paths(model: Any) -> dict[str, str | None]:
    """Where the guide tells a spec author to look: the decoder stack, its layer list and the LM head."""
    from torch.nn import ModuleList

    paths = {"language_model": "model", "lm_head": "lm_head", "language_layers": "model.layers"}
    for path, module in model.named_modules():
        if hasattr(module, "embed_tokens") and hasattr(module, "layers"):
            paths["language_model"] = path
            break
    else:
        prefix = getattr(model, "base_model_prefix", "")
        if prefix and hasattr(model, prefix):
            paths["language_model"] = prefix
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    for path, module in model.named_modules():
        if head is not None and module is head:
            paths["lm_head"] = path
            break
    stack = model.get_submodule(paths["language_model"]) if _has(model, paths["language_model"]) else None
    found = (  # the first list of modules outside a vision tower (GIT keeps its image encoder's first)
        name
        for name, child in (stack.named_modules() if stack is not None else ())
        if isinstance(child, ModuleList) and not any(word in name for word in TOWER_NAMES)
    )
    paths["language_layers"] = f"{paths['language_model']}.{next(found, 'layers')}".strip(".")
    layers = model.get_submodule(paths["language_layers"]) if _has(model, paths["language_layers"]) else None
    first = next(iter(layers), None) if isinstance(layers, ModuleList) else None
    return {
        **paths,
        **(_stack_parts(stack) if stack is not None else {}),
        **(_layer_attention(first) if first is not None else {}),
    }


def _layer_attention(layer: Any) -> dict[str, str]:
    """``module_paths.layer_attention`` where the usual names (the runtime's ``MIXER_ATTRIBUTES``) find no
    attention in the first decoder layer that knows its index, or one that does not (GIT's ``attention``
    keeps it one level down, ``attention.self``): the first submodule whose class name says attention that
    caches under index 0 (``INDEX_ATTRIBUTES``); none where the usual names find one (a list of
    attentions, LongCat-Flash's, is then refused by name) or nothing qualifies."""
    from torch.nn import ModuleList

    from ..backends.extraction.runtime import abi as runtime

    try:
        usual = runtime.mixer_of(layer, "attention")
        if isinstance(usual, ModuleList) or runtime.index_of(usual) is not None:
            return {}
    except ValueError:
        pass
    found = (
        path
        for path, module in layer.named_modules()
        if path and "attention" in type(module).__name__.lower() and runtime.index_of(module) == 0
    )
    path = next(found, None)
    return {"layer_attention": path} if path is not None else {}


def _stack_parts(stack: Any) -> dict[str, str | None]:
    """Where the stack keeps the parts the wrappers call, as ``module_paths`` keys, when not at
    transformers' usual names (``STACK_PARTS``): its input embedding, its last direct child that is a
    norm, a direct child that is a rotary embedding (Mamba2: ``embeddings``, ``norm_f``; Bamba:
    ``final_layernorm``; None where it has no norm child at all: post-norm layers, TrOCR), and a direct
    child that embeds positions, which has no usual name (GPT-2's
    ``wpe``, OPT's ``embed_positions``: an embedding named ``POSITION_NAMES``, learned or not; else a
    buffer so named, CTRL's ``pos_encoding``) and a norm
    over the embeddings (BLOOM's ``word_embeddings_layernorm``: a norm whose name says ``emb``, registered
    before the layer list), which have none."""
    from torch.nn import ModuleList

    from ..backends.extraction.ir.stack import POSITION_NAMES
    from ..spec.model import STACK_PARTS

    children = list(stack.named_children())
    embedding = stack.get_input_embeddings() if hasattr(stack, "get_input_embeddings") else None
    holder = _embedding_holder(stack, embedding)
    if holder:  # the token table inside an embeddings module (GIT, ModernBERT): its parts, by path
        children = [(f"{holder}.{n}", c) for n, c in stack.get_submodule(holder).named_children()] + [
            (n, c) for n, c in children if n != holder
        ]

    def last(kind: str) -> str | None:  # the last direct child whose class name says it is a ``kind``
        return next((name for name, c in reversed(children) if kind in type(c).__name__.lower()), None)

    before_layers = list(itertools.takewhile(lambda item: not isinstance(item[1], ModuleList), children))
    embedding_norm = next(  # LFM2's final norm is named embedding_norm too, after its layers
        (
            name
            for name, child in before_layers
            if child is not embedding
            and (name.startswith(f"{holder}.") if holder else "emb" in name)
            and "norm" in type(child).__name__.lower()
        ),
        None,
    )
    children = [(name, child) for name, child in children if name != embedding_norm]
    found = {
        "embeddings": next((name for name, child in children if child is embedding), None),
        "final_norm": last("norm"),
        "embedding_norm": embedding_norm,
        "rotary_embedding": last("rotary"),
        "position_embeddings": next(
            (
                name
                for name, child in children
                if child is not embedding
                and any(word in name.lower() for word in POSITION_NAMES)
                and "embedding" in type(child).__name__.lower()
                and "rotary" not in type(child).__name__.lower()
            ),
            # else a table the stack keeps as a buffer (CTRL's sinusoidal pos_encoding; not position_ids)
            next(
                (
                    name
                    for name, buffer in stack.named_buffers(recurse=False)
                    if "pos" in name.lower() and buffer.is_floating_point()
                ),
                None,
            ),
        ),
    }
    written: dict[str, str | None] = {  # a part without a usual name (None) wherever the stack has it
        key: name
        for key, name in found.items()
        if name and (STACK_PARTS[key] is None or not hasattr(stack, str(STACK_PARTS[key])))
    }
    if found["final_norm"] is None and not hasattr(stack, str(STACK_PARTS["final_norm"])):
        written["final_norm"] = None  # no norm at all (post-norm layers: TrOCR): the stack applies none
    return written


def _embedding_holder(stack: Any, embedding: Any) -> str:
    """The path of the module that holds the stack's token embedding when that is not a direct child of
    the stack (GIT's ``embeddings.word_embeddings``: ``embeddings``, which also holds its position table
    and the norm over both); "" where it is a direct child, or the stack has none."""
    path = next((name for name, module in stack.named_modules() if module is embedding and name), "")
    return path.rpartition(".")[0]


def _has(model: Any, path: str) -> bool:
    try:
        model.get_submodule(path)
    except AttributeError:
        return False
    return True


def write_spec(folder: Path, model_type: str, config: dict[str, Any], paths: dict[str, str | None]) -> Path:
    """The guide's spec for ``model_type`` on ``config`` (written to ``folder/model_type/config.json``)."""
    (folder / model_type).mkdir(parents=True, exist_ok=True)
    (folder / model_type / "config.json").write_text(json.dumps(config, default=str))
    abi_config = "  config: text_config\n" if isinstance(config.get("text_config"), dict) else ""
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    states, past = _state_templates(text)
    capacity = _capacity(text)
    spec = folder / f"{model_type.replace('-', '_')}.yaml"
    spec.write_text(
        textwrap.dedent(
            f"""\
            apiVersion: kadapt/v1
            kind: AdapterSpec
            metadata: {{name: {json.dumps(model_type.replace("-", "_"))}}}
            gate: {{model_type: {json.dumps(model_type)}}}
            source: {{config: {json.dumps(model_type + "/config.json")}}}
            config_bridges:
              - {{id: X1, why: eager attention exports as plain ops, op: set, path: _attn_implementation,
                  value: eager, backends: [extraction]}}
              - {{id: X2, why: batched_mm experts export with static shapes, op: set,
                  path: _experts_implementation, value: batched_mm, backends: [extraction]}}
            module_paths: {json.dumps(paths)}
            """
        )
        + (
            f"architecture: {{fields: {json.dumps(GUIDE_FIELDS[model_type])}}}\n"
            if model_type in GUIDE_FIELDS
            else ""
        )
        + _patches_yaml(model_type, text)
        + "abi:\n"
        + abi_config
        + textwrap.indent(
            textwrap.dedent(
                """\
                batch: 1
                prefill_len: 8
                max_cache_len: CAPACITY
                dtype: float32
                prefill:
                  inputs: [input_ids, attention_mask, position_ids]
                  outputs: [logits, "k.{layer}", "v.{layer}"STATES]
                decode:
                  inputs: [input_ids, attention_mask, position_ids, cache_position,
                           "pk.{layer}", "pv.{layer}"PAST]
                  outputs: [logits, "k.{layer}", "v.{layer}"STATES]
                """
            )
            .replace("STATES", states)
            .replace("PAST", past)
            .replace("CAPACITY", str(capacity)),
            "  ",
        )
    )
    return spec


def _capacity(text: dict[str, Any]) -> int:
    """The guide's ``max_cache_len``: 64, or its least multiple of every compressed layer's rate (their
    entries take ``max_cache_len / rate`` slots; DeepSeek-V4's hca layers fold 128 tokens per entry)."""
    from ..structure.derive import derive_structure

    try:
        rates = [c.rate for c in derive_structure(text).compressors.values()]
    except KadaptError:
        return 64
    return math.lcm(64, *rates)


def _patches_yaml(model_type: str, text: dict[str, Any]) -> str:
    """The ``patches:`` section of ``GUIDE_PATCHES[model_type]`` and the ``GUIDE_LAYER_PATCHES`` of the
    layer types the text config lists (empty for most types), one flow mapping per patch (JSON is
    YAML)."""
    types = text.get("layer_types") if isinstance(text.get("layer_types"), list) else []
    layer = [patch for kind in GUIDE_LAYER_PATCHES if kind in types for patch in GUIDE_LAYER_PATCHES[kind]]
    patches = (*GUIDE_PATCHES.get(model_type, ()), *layer)
    if not patches:
        return ""
    return "patches:\n" + "".join(f"  - {json.dumps(patch)}\n" for patch in patches)


def _state_templates(text: dict[str, Any]) -> tuple[str, str]:
    """The states besides key and value a stack's layers return, and take back, named as a user names
    them: a linear layer's conv and recurrent state, a DSA layer's indexer keys, a compressed layer's
    ring and entries (a csa layer's indexer's too; none when the config says neither, or is refused: the
    trial reports that where apply raises it)."""
    from ..structure.derive import derive_structure

    try:
        kinds = set(derive_structure(text).layer_kinds)
    except KadaptError:
        return "", ""
    # a lightning layer uses the recurrent template alone, a short convolution the conv template alone
    if kinds & {"linear", "lightning", "short_conv", "hybrid"}:
        return ', "c.{layer}", "r.{layer}"', ', "pc.{layer}", "pr.{layer}"'
    if "indexed" in kinds:
        return ', "i.{layer}"', ', "pi.{layer}"'
    if "csa" in kinds:  # a compressor's ring and entries, then its indexer's
        return (
            ', "cs.{layer}", "ce.{layer}", "is.{layer}", "ie.{layer}"',
            ', "pcs.{layer}", "pce.{layer}", "pis.{layer}", "pie.{layer}"',
        )
    if "hca" in kinds:  # a compressor's ring and entries
        return ', "cs.{layer}", "ce.{layer}"', ', "pcs.{layer}", "pce.{layer}"'
    return "", ""


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _classify(exc: BaseException) -> tuple[str, str, str]:
    from ..errors import KadaptError, Refusal
    from ..upstream import ContactPointMoved, LayersUnsupported

    if isinstance(exc, Refusal):
        return REFUSED, exc.code, _one_line(exc.message.partition(": ")[2])
    if isinstance(exc, LayersUnsupported):
        return REFUSED, exc.code, _one_line(exc.findings[0].found)
    if isinstance(exc, ContactPointMoved):
        return FAILED, "contact-point", _one_line(str(exc))
    if isinstance(exc, KadaptError):
        return FAILED, "error", _one_line(exc.message)
    frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
    where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
    return FAILED, "traceback", _one_line(f"{type(exc).__name__}: {exc}{where}")


def buildable_config(model_type: str) -> tuple[dict[str, Any], Any] | str:
    """The small config (else transformers' default) and the model transformers builds from it on
    meta (the class kadapt builds, without kadapt's patches); or why neither builds."""
    import torch
    from transformers import CONFIG_MAPPING, AutoConfig

    from ..loading import model_class
    from .tiny import tiny_config

    def small() -> dict[str, Any]:
        return tiny_config(model_type)

    def default() -> dict[str, Any]:
        return {**CONFIG_MAPPING[model_type]().to_dict(), "model_type": model_type}

    failure = ""
    for make in (small, default):
        try:
            config = make()
            built = AutoConfig.for_model(**config)
            with torch.device("meta"):
                return config, model_class(built)._from_config(built)
        except Exception as exc:  # noqa: BLE001 - transformers' own default does not build
            failure = failure or _one_line(f"{type(exc).__name__}: {exc}")
    return f"transformers' own default config does not build a model: {failure}"


def _upstream_failure(config: dict[str, Any]) -> str | None:
    """Why transformers' own model of ``config`` (unpatched, random float32 weights on CPU) does not run
    its forward on a few tokens, or None when it does. A trial that fails where transformers' own model
    fails too has nothing to be compared against (transformers 5.24's Llama4ForConditionalGeneration
    reads ``image_outputs`` from its language model's output, which has none): untested, not failed."""
    import torch
    from transformers import AutoConfig

    from ..loading import model_class

    built = AutoConfig.for_model(**config)
    name = model_class(built).__name__
    torch.manual_seed(0)
    try:
        model = model_class(built)._from_config(built).float().eval()
        with torch.no_grad():
            model(input_ids=torch.tensor([[3, 4, 5, 6]]))
    except Exception as exc:  # noqa: BLE001 - whatever transformers' own forward raises
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f" ({Path(frame.filename).name}:{frame.lineno})" if frame else ""
        return _one_line(f"transformers' own {name} does not run: {type(exc).__name__}: {exc}{where}")
    return None


def _plan_census(spec: Any, model: Any, folder: Path) -> list[str]:
    """What keeps plan's inventory from being ``model`` (``census``), or why plan refuses the spec
    (its paths relative to the trial's ``folder``, so the page stays the same from run to run)."""
    from ..backends.simulation.model.census import census
    from ..backends.simulation.model.inputs import model_inputs

    try:
        inputs = model_inputs(spec, None)
    except KadaptError as exc:  # the spec's plan refuses what verify adapts: a plan fact, not the row's
        return [f"plan refuses it: {str(exc).replace(f'{folder}/', '')}"]
    return census(inputs.groups, inputs.naming, model).problems()


def run_trial(model_type: str) -> Row:
    """``model_type`` through validate --resolve, apply and verify, and plan's census; its row.

    Each trial starts from no probe results (``upstream.forget``), as in a process of its own: a layer's
    result is keyed by the methods its classes hold (one probed under Scout's builtins for
    ``llama4_text`` no longer answers for the same classes without them), but the library
    probes are cached by name alone, whatever an earlier trial's patches changed."""
    from .. import upstream
    from ..backends import extraction
    from ..loading import applied, load_model
    from ..resolve import resolve_diagnostics
    from ..spec import load_spec
    from ..spec.loader import check_spec

    upstream.forget()
    with tempfile.TemporaryDirectory(prefix=f"kadapt-family-{model_type}-") as tmp:
        folder = Path(tmp)
        found = buildable_config(model_type)
        if isinstance(found, str):
            return Row(model_type, UNTESTED, "default-config", found)
        config, built = found
        spec_path = write_spec(folder, model_type, config, module_paths(built))
        checked = check_spec(spec_path)
        if checked.diagnostics:  # plain validate refuses what it can read from the config alone
            message = checked.diagnostics[0].message
            refused = parse_refusal(message)
            if refused:
                return Row(model_type, REFUSED, refused[0], _one_line(refused[1]))
            return Row(model_type, FAILED, "spec", _one_line(message))
        spec = load_spec(spec_path)
        out = folder / "out"
        try:
            findings = resolve_diagnostics(spec, spec_path)
            resolved = [d for d in findings if parse_refusal(d.message)]
            if findings and not resolved:
                return Row(model_type, FAILED, "resolve", _one_line(findings[0].message))
            options = extraction.options_from_spec(spec, output_dir=out)
            with applied(spec, backend="extraction"):  # apply's checks, in its order, on the spec's model
                model = load_model(spec, device="meta")
                extraction.check(spec, model, options, echo=lambda line: None)
            misplanned = _plan_census(spec, model, folder)
            options = dataclasses.replace(options, verify_dtypes=("float32",))
            report = extraction.verify(spec, options, echo=lambda line: None, keep_in=out)
        except BaseException as exc:  # noqa: BLE001 - every outcome is a row
            if isinstance(exc, KeyboardInterrupt):
                raise
            outcome, code, detail = _classify(exc)
            upstream_failure = _upstream_failure(config) if outcome == FAILED else None
            if upstream_failure is not None:
                return Row(model_type, UNTESTED, "upstream-forward", upstream_failure)
            if outcome == REFUSED and out.exists() and any(out.iterdir()):
                return Row(model_type, FAILED, "refused-late", f"{code} after writing files: {detail}")
            return Row(model_type, outcome, code, detail)
        if not report.passed:
            failed = [c for c in report.checks if not c.passed]
            return Row(model_type, FAILED, "verify", _one_line(f"{failed[0].name}: {failed[0].detail}"))
        return Row(
            model_type,
            ADAPTED,
            "",
            _one_line(f"{report.attention_label}; verify max |diff| {report.max_logit_diff:.1e}"),
            _one_line("departs: " + "; ".join(misplanned), 200) if misplanned else PLAN_EXACT,
        )
