"""What the generated extraction module carries of the step graph's drafts (issue 39): EAGLE-3 aux layers
and the MTP draft graph.

The step graph's aux layers (``abi.step.aux_layers``) are baked in as ``STEP_AUX_LAYERS``, the step
wrapper's, names', mapping's and ``save_ir``'s default, which a caller overrides as it does the step's
sizes. A spec whose config states one MTP layer (DeepSeek-V3, GLM-4.5: transformers' config reads
``num_mtp_layers``) also gets the MTP draft graph: ``runtime/mtp.py`` embedded verbatim, its ABI names
(``step_options.mtp_graph_names``, as ``kadapt apply --step-mtp`` names it) and ``STEP_MTP``
(``abi.step.mtp``), whether the step graph returns the final hidden states the draft graph reads. What
``kadapt apply`` refuses is refused here with its reason, located at the spec entry: an
``abi.step.mtp`` whose config has no MTP layer (or whose transformers has no ``MtpModel``); aux layers
past the stack are refused by ``load_spec`` already (``against_config``).
Whether a config has the layer is read from transformers' config of it, as ``apply`` reads it: a raw
``num_nextn_predict_layers`` its config class does not read (DeepSeek-V3.2, V4) builds no MTP layer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..backends.extraction.runtime import mtp
from ..backends.extraction.step_options import AUX, HIDDEN, mtp_graph_names
from ..loading import load_config
from ..spec.model import Spec
from .common import cannot
from .embed import EmbeddedModule, split_module


def serving_context(
    spec: Spec, target: str, provided: frozenset[str]
) -> tuple[dict[str, Any], EmbeddedModule | None]:
    """The template's ``serving`` context, and ``runtime/mtp.py`` split for embedding (None: the config
    has no MTP layer); ``provided``: the names the embedded runtime defines, which ``mtp.py`` imports."""
    assert spec.abi is not None
    stated = spec.abi.step
    aux = tuple(stated.aux_layers) if stated is not None else ()  # checked against the config on load
    config = load_config(spec, backend="extraction")
    wanted = stated is not None and stated.mtp
    refusal = mtp.mtp_refusal(config) if wanted else None
    if refusal is not None:
        raise cannot(spec, target, f"no MTP draft graph: {refusal}", "abi.step.mtp")
    embedded = None
    graph = None
    if mtp.mtp_layer_refusal(config) is None:
        embedded = split_module(Path(mtp.__file__), provided=provided)
        names = mtp_graph_names(spec.abi.kv_cache.block_table)
        graph = {
            "inputs": names.inputs(1),
            "outputs": names.outputs(1),
            "body": embedded.body,
            "source": embedded.source,
        }
    context = {"aux_layers": aux, "mtp": wanted, "hidden": HIDDEN, "aux": AUX, "mtp_graph": graph}
    return context, embedded
