"""A paged KV cache as one run exports it (``abi.kv_cache: paged``): block size, pool size, block-table
name, checked against the ABI sizes. Torch-free, like ``options``, which re-exports it; its own module so
that ``step_options`` reads it without importing ``options``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ...errors import KadaptError
from ...spec.model import KvCacheAbi, paged_name_problems, paged_size_problems

KV_CACHES = ("contiguous", "paged")


@dataclass(frozen=True)
class PagedOptions:
    """``abi.kv_cache: paged``: decode KV as block pools ``[num_blocks, block_size, heads, dim]``."""

    block_size: int
    num_blocks: int
    block_table: str  # name of the decode graph's block-table input, after cache_position


def paged_options(
    kv_cache: KvCacheAbi,
    *,
    batch: int,
    max_cache_len: int,
    decode_inputs: Iterable[str],
    where: Callable[[str], str | None],
) -> PagedOptions | None:
    """The paged cache ``kv_cache`` describes, checked against the ABI sizes and the decode graph's
    other inputs (None: contiguous); ``where(field)`` locates a problem with that field."""
    if kv_cache.kind not in KV_CACHES:
        raise KadaptError(
            f"unknown kv_cache {kv_cache.kind!r}; valid: {', '.join(KV_CACHES)}", location=where("kind")
        )
    if kv_cache.kind == "contiguous":
        return None
    size = kv_cache.block_size
    problems = [
        *paged_size_problems(size, kv_cache.num_blocks, max_cache_len),
        *paged_name_problems(kv_cache.block_table, decode_inputs),
    ]
    if problems:
        field, message = problems[0]
        raise KadaptError(f"kv_cache {message}", location=where(field))
    num_blocks = kv_cache.num_blocks if kv_cache.num_blocks is not None else batch * (max_cache_len // size)
    return PagedOptions(size, num_blocks, kv_cache.block_table)
