"""Shared prompt prefixes: a request's block hashes as an engine's cache keys, and the hit rate an
infinite cache would reach on a workload.

A workload's hashes refer to blocks of ``block_tokens`` tokens (512 in the Mooncake trace, 64 in the
request log); an engine caches blocks of its own ``block_size``. Engine block ``j`` holds tokens
``[j * block_size, (j + 1) * block_size)``: its key is chained, as the live engine's is, from the key
of block ``j - 1``, the block's offset inside the first hashed block it overlaps, and the hashes of
every hashed block it overlaps. Two requests get the same key for block ``j`` exactly when their
hashes agree on every hashed block up to the end of block ``j``. Only blocks that lie wholly inside
the prompt get a key (the live engine caches full blocks only), and none beyond the hashed tokens.

Keys are Python ``hash`` values of integer tuples: the same in every process (no string hashing).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from prism_serve.workload.format import Workload

__all__ = ["block_keys", "cacheable_blocks", "infinite_cache_hits", "prefix_hit_rate"]


def block_keys(
    hashes: Sequence[int], hash_block_tokens: int, prompt_tokens: int, block_size: int
) -> tuple[int, ...]:
    """Chained keys of the prompt's full ``block_size``-token blocks that ``hashes`` cover."""
    if not hashes:
        return ()
    n = min(prompt_tokens, len(hashes) * hash_block_tokens) // block_size
    keys = []
    prev = 0
    for j in range(n):
        start = j * block_size
        first = start // hash_block_tokens
        last = (start + block_size - 1) // hash_block_tokens
        prev = hash((prev, start - first * hash_block_tokens, *hashes[first : last + 1]))
        keys.append(prev)
    return tuple(keys)


def cacheable_blocks(prompt_tokens: int, block_size: int) -> int:
    """The most leading blocks a request may take from a cache: at least its last prompt token is
    always computed (its logits give the first output token)."""
    return max(0, prompt_tokens - 1) // block_size


def infinite_cache_hits(workload: Workload, block_size: int) -> np.ndarray:
    """Per request (arrival order), the prompt tokens an unbounded cache per model would hold when
    it arrives: the longest leading run of its block keys that any earlier request of the same
    model had, capped by ``cacheable_blocks``. Zeros for a workload without hashes."""
    hits = np.zeros(len(workload), dtype=np.int64)
    if workload.block_hashes is None:
        return hits
    seen: dict[int, set[int]] = {}
    bt = workload.block_tokens
    for i, (m, p, hashes) in enumerate(
        zip(
            workload.model_index.tolist(), workload.prompt_tokens.tolist(), workload.block_hashes, strict=True
        )
    ):
        keys = block_keys(hashes, bt, p, block_size)
        cache = seen.setdefault(m, set())
        k = 0
        for key in keys[: cacheable_blocks(p, block_size)]:
            if key not in cache:
                break
            k += 1
        hits[i] = k * block_size
        cache.update(keys)
    return hits


def prefix_hit_rate(cached_tokens: int, prompt_tokens: int) -> float:
    """Cached prompt tokens over prompt tokens (0.0 for no prompt tokens)."""
    return cached_tokens / prompt_tokens if prompt_tokens > 0 else 0.0
