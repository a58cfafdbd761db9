"""The dense layers' MLP width, read from a config as each family states it.

Apart from ``derive.py`` because families state it in their own ways (a separate dense width beside the
experts', a width adjusted at build time) and ``derive.py`` stays under 500 lines.
"""

from __future__ import annotations

from .reader import Reader

# the key GPT-2, GPT-J and CodeGen state their MLP width in, whose null means four times the hidden size
# (their MLPs are built with ``4 * n_embd`` then)
FOUR_X_WHEN_NULL = "n_inner"


def dense_width_of(read: Reader) -> int:
    """The dense layers' MLP width: Llama-4 keeps it apart from the experts' (``intermediate_size_mlp``
    beside ``intermediate_size``), the other families in ``intermediate_size``; LFM2 adjusts it as its
    ``Lfm2MLP`` does (``block_auto_adjust_ff_dim``: 2/3 of it, times ``block_ffn_dim_multiplier``, rounded
    up to a multiple of ``block_multiple_of``); a null ``n_inner`` is four times the hidden size, and
    GPT-NeoX-Japanese states a multiple of it (``intermediate_multiple_size``)."""
    width = int(read.get("dense_intermediate_size") or read.get("intermediate_size", 0) or 0)
    multiple = read.get("intermediate_multiple")
    if not width and multiple:
        width = int(multiple) * int(read.require("hidden_size"))
    if not width and read.raw(FOUR_X_WHEN_NULL) is None:  # the key present, null (MISSING: absent)
        width = 4 * int(read.require("hidden_size"))
    if not read.get("ffn_auto_adjust"):
        return width
    width = int(2 * width / 3)
    multiplier = read.get("ffn_dim_multiplier")
    if multiplier is None:
        return width
    multiple = int(read.require("ffn_multiple_of"))
    return multiple * -(-int(multiplier * width) // multiple)
