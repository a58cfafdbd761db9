"""Chunked gated-delta scans with a compact triangular inverse, for export.

transformers' chunked delta-rule scans (the gated DeltaNet's ``torch_chunk_gated_delta_rule`` in
Qwen3-Next, Qwen3.5 and the stacks copied from them; Kimi-Linear's ``chunk_kimi_delta_attention``)
invert each chunk's unit lower-triangular system ``I - A`` by forward substitution when exporting: a
Python loop of ``chunk_size - 1`` (63) in-place row updates. Traced, that loop is ~800 graph nodes per
linear layer: Qwen3-Next's prefill export took 17.9 s and its IR held 17.4 MB (3.8 s and 4.9 MB without).

``compact_delta_scan`` wraps a linear-attention layer's forward: for the duration of the call, each
function of the layer's modelling module that holds the loop is swapped for the same function rebuilt
from its own source with the loop (and the ``+ eye`` after it) replaced by ``unit_lower_inverse``.
Everything else in the scan is upstream's code, unchanged; where the loop is not found verbatim (a
release that rewrote the scan) upstream's function runs as it is.

Only the inverse's rounding differs from the loop's (float32, ~1e-7 relative). transformers' own eager
gated-DeltaNet scan does not run the loop either (``torch.linalg.solve_triangular``), so ``--verify``'s
reference already differs from the graph in that rounding. Kimi-Linear's eager scan runs the loop, and
its bf16 graph was bit-identical to it: with this inverse one KDA output element in ~2,000 lands one bf16
step away, which flips a near-tied expert choice of the tiny MoE and fails its bf16 check, so
``specs/kimi_linear.yaml`` does not use this wrap.
"""

from __future__ import annotations

import inspect
import re
import textwrap
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

# upstream's forward substitution of ``I - A`` (``A`` strictly lower, held in ``name``) and the identity
# added after it, in every release and modelling module that has it (5.23 and 5.24: kimi_linear,
# qwen3_next, qwen3_5, qwen3_5_moe, olmo_hybrid, bailing_hybrid, glm5_next, qwen4_exp; 5.24: lara_mini), one
# line each (a tuple: generated modules embed it as a literal, each part within the line length)
_LOOP = (
    r"(?P<indent>[ \t]*)for i in range\(1, chunk_size\):\n",
    r"[ \t]+row = (?P<name>\w+)\[\.\.\., i, :i\]\.clone\(\)\n",
    r"[ \t]+sub = (?P=name)\[\.\.\., :i, :i\]\.clone\(\)\n",
    r"[ \t]+(?P=name)\[\.\.\., i, :i\] = row \+ \(row\.unsqueeze\(-1\) \* sub\)\.sum\(-2\)\n",
    r"(?:[ \t]*\n)*",
    r"[ \t]*(?P=name) = (?P=name) \+ torch\.eye\(chunk_size, dtype=(?P=name)\.dtype, ",
    r"device=(?P=name)\.device\)\n",
)
_INVERSE = "_kadapt_unit_lower_inverse"


def unit_lower_inverse(strict_lower: torch.Tensor) -> torch.Tensor:
    """``(I - A)^-1`` for ``A`` strictly lower-triangular over its last two dimensions ``[..., n, n]``.

    Recursive 2x2 block inversion, all blocks of a level at once: with ``X`` the block-diagonal
    inverse over blocks of size ``s``, the inverse over blocks of ``2s`` is ``X + X (A * M) X``, where
    ``M`` keeps the entries of ``A`` inside a ``2s`` block but outside its two ``s`` blocks (for
    ``[[X1, 0], [0, X2]]`` that adds ``X2 A21 X1``, the block-triangular inverse). ``ceil(log2 n)``
    levels of two matmuls each, instead of ``n - 1`` sequential row updates."""
    n = strict_lower.shape[-1]
    index = torch.arange(n, device=strict_lower.device)
    inverse = torch.eye(n, dtype=strict_lower.dtype, device=strict_lower.device).expand_as(strict_lower)
    size = 1
    while size < n:
        same_pair = (index.unsqueeze(-1) // (2 * size)) == (index // (2 * size))
        same_block = (index.unsqueeze(-1) // size) == (index // size)
        across = strict_lower * (same_pair & ~same_block).to(strict_lower.dtype)
        inverse = inverse + inverse @ across @ inverse
        size *= 2
    return inverse


def _rebuilt(function: types.FunctionType) -> types.FunctionType | None:
    """``function`` compiled again from its source with the forward substitution replaced, in a copy
    of its module's globals; None when its source does not hold the loop."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        return None
    match = re.search("".join(_LOOP), source)
    if match is None:
        return None
    body = source[source.index("def ") :]  # drop upstream's kernel-hub decorators
    start = body.index(match.group(0))
    replaced = f"{match['indent']}{match['name']} = {_INVERSE}({match['name']})\n"
    body = body[:start] + replaced + body[start + len(match.group(0)) :]
    namespace = dict(function.__globals__)
    namespace[_INVERSE] = unit_lower_inverse
    exec(
        compile(body, f"<kadapt compact scan of {function.__module__}.{function.__qualname__}>", "exec"),
        namespace,
    )
    return namespace[function.__name__]


# where a modelling module's rebuilt scans are kept, in that module's own namespace (built once per process)
_CACHE_KEY = "__kadapt_compact_scans__"


def _swaps(module_globals: dict[str, Any]) -> dict[str, Callable[..., Any]]:
    """The scans of a modelling module that hold the loop, by global name, rebuilt once per module."""
    if _CACHE_KEY not in module_globals:
        name = module_globals["__name__"]
        found: dict[str, Callable[..., Any]] = {}
        for attr, value in list(module_globals.items()):
            function = inspect.unwrap(value) if callable(value) else None
            if isinstance(function, types.FunctionType) and function.__module__ == name:
                if (rebuilt := _rebuilt(function)) is not None:
                    found[attr] = rebuilt
        module_globals[_CACHE_KEY] = found
    return module_globals[_CACHE_KEY]


@contextmanager
def _swapped(module_globals: dict[str, Any]) -> Iterator[None]:
    swaps = _swaps(module_globals)
    saved = {attr: module_globals[attr] for attr in swaps}
    module_globals.update(swaps)
    try:
        yield
    finally:
        module_globals.update(saved)


def compact_delta_scan(original: Callable[..., Any], self: Any, *args: Any, **kwargs: Any) -> Any:
    """``wrap`` impl for a linear-attention layer's ``forward``: upstream's forward, with its modelling
    module's chunked scans using ``unit_lower_inverse`` for the duration of the call."""
    with _swapped(inspect.unwrap(original).__globals__):
        return original(self, *args, **kwargs)
