"""How the engine groups decodes for attention, without torch: the simulator counts the same keys.

Decodes are attended in batched calls over their gathered block tables, each padded to its group's
longest context; grouping by context length keeps a short context from being padded to the longest
one of a mixed batch.
"""

from __future__ import annotations

__all__ = ["GROUP_RATIO", "MAX_GROUPS", "group_decodes", "padded_decode_context"]

GROUP_RATIO = 0.6  # a decode joins the group of longer contexts while it has >= this share of its keys
MAX_GROUPS = 4  # SDPA calls per layer for the decodes, at most


def group_decodes(lens: list[int]) -> list[list[int]]:
    """Decode rows (indices into ``lens``) in groups of similar context length: longest first, a
    new group starts where a context is shorter than ``GROUP_RATIO`` of its group's longest."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (lens[i] >= GROUP_RATIO * lens[groups[-1][0]] or len(groups) == MAX_GROUPS):
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]


def padded_decode_context(lens: list[int]) -> int:
    """Keys the engine's decode attention reads for decodes of these context lengths: each decode
    is padded to the longest context of its group (``group_decodes``)."""
    return sum(len(g) * max(lens[i] for i in g) for g in group_decodes(lens))
