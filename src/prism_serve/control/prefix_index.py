"""Which prompt prefixes each replica probably holds in its engine's prefix cache.

The engines cache the full KV blocks of the prompts they computed (engine/prefix_cache.py, and the
simulator's sim/prefix_cache.py); a request whose leading blocks one replica holds prefills only
the rest there. The control plane cannot see those caches. It keeps an *approximate* index instead,
learned from its own decisions, as llm-d's approximate prefix scorer does: a request's prefix keys
(``Request.prefix_keys``, one per ``PREFIX_BLOCK_TOKENS`` tokens, chained, so a key names the whole
prefix up to the end of its block) are recorded on the replica the request was routed to, at
routing time. A later request's expected hit on a replica is the longest leading run of its keys
recorded there (:meth:`PrefixIndex.match`).

Bounds. Each replica holds at most as many keys as its engine's KV holds blocks of
``PREFIX_BLOCK_TOKENS`` tokens (:func:`capacity_blocks`), least recently routed first out; a
request's keys are recorded tail first, so its first block is the most recent and an old prompt's
tail goes before its head, as an engine gives a finished request's blocks back last block first
(a head that went would make the whole chain unmatchable). A replica's keys are forgotten when it
is evicted, migrated or its worker dies (the control loop calls :meth:`PrefixIndex.forget`), and
whenever a snapshot shows it placed anew since they were learned (:meth:`PrefixIndex.sync`: an
operator's unload goes around the loop). Keys recorded while a replica was evicted (a request that
waits for its activation) carry over to the activation that follows.

What it gets wrong, on purpose (it is a routing hint, not the cache): a request counts as cached
once routed, before its prefill ran (a burst of one new prefix all goes to one replica, which is
what lets the later ones hit); blocks the engine gave up under memory pressure, for another
engine's KV, are still counted; and its granularity is ``PREFIX_BLOCK_TOKENS``, coarser than the
engines' blocks, so its hits are a lower bound of theirs when it is right.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from prism_serve.control.types import PREFIX_BLOCK_TOKENS, ClusterSnapshot, InvalidSnapshotError

__all__ = ["DEFAULT_MAX_BLOCKS", "PrefixIndex", "capacity_blocks"]

# keys kept for a replica whose cache size is not known yet (evicted, no engine reported): 4M tokens
DEFAULT_MAX_BLOCKS = 1 << 16


class PrefixIndex:
    """Per replica, the prefix keys it probably holds (see the module docstring). Pure state: no
    clock, no I/O; the control loop owns one and feeds it."""

    __slots__ = ("_capacity", "_default_blocks", "_held", "_seen", "block_tokens")

    def __init__(
        self, block_tokens: int = PREFIX_BLOCK_TOKENS, default_blocks: int = DEFAULT_MAX_BLOCKS
    ) -> None:
        if block_tokens < 1 or default_blocks < 0:
            raise InvalidSnapshotError("block_tokens must be >= 1 and default_blocks >= 0")
        self.block_tokens = block_tokens
        self._default_blocks = default_blocks
        # replica -> its keys, least recently routed first
        self._held: dict[str, OrderedDict[int, None]] = {}
        self._capacity: dict[str, int] = {}  # replica -> the most keys it holds (last known)
        self._seen: dict[str, tuple[bool, float | None]] = {}  # replica -> (resident, placed_at)

    def __len__(self) -> int:
        """Keys held over every replica."""
        return sum(len(keys) for keys in self._held.values())

    def blocks(self, replica: str) -> int:
        """How many keys ``replica`` holds."""
        keys = self._held.get(replica)
        return len(keys) if keys is not None else 0

    def match(self, replica: str, keys: Sequence[int]) -> int:
        """Prompt tokens of ``keys`` (a request's prefix keys) that ``replica`` probably holds: the
        longest leading run of them recorded there, in tokens."""
        held = self._held.get(replica)
        if not held:
            return 0
        n = 0
        for key in keys:
            if key not in held:
                break
            n += 1
        return n * self.block_tokens

    def cached_tokens(self, replica: str, keys: Sequence[int], prompt_tokens: int) -> int:
        """:meth:`match` capped as an engine caps a hit: at least the prompt's last token is
        computed (its logits give the first output token)."""
        most = max(0, prompt_tokens - 1) // self.block_tokens * self.block_tokens
        return min(self.match(replica, keys), most)

    def record(self, replica: str, keys: Sequence[int], capacity: int | None = None) -> None:
        """``replica`` was sent a request with these prefix keys: they are its most recent, the
        first key last of all; then it keeps at most ``capacity`` keys (None: as many as it last
        could, or ``default_blocks`` if never told), the least recent going first."""
        if capacity is not None:
            self._capacity[replica] = max(0, capacity)
        limit = self._capacity.get(replica, self._default_blocks)
        held = self._held.get(replica)
        if held is None:
            if not keys or not limit:
                return
            held = self._held[replica] = OrderedDict()
        for key in reversed(keys):
            if key in held:
                held.move_to_end(key)
            else:
                held[key] = None
        while len(held) > limit:
            held.popitem(last=False)
        if not held:
            del self._held[replica]

    def forget(self, replica: str) -> None:
        """``replica``'s engine is gone (evicted, migrated, its worker died): it holds nothing."""
        self._held.pop(replica, None)

    def sync(self, replica: str, resident: bool, placed_at: float | None) -> None:
        """What a snapshot shows of ``replica`` now: its keys are forgotten if it was resident when
        last seen and is now evicted or placed anew (``placed_at`` changed: an eviction and a new
        activation between two looks, by an operator say). Keys recorded while it was evicted stay:
        they are the requests waiting for its activation."""
        last = self._seen.get(replica)
        now = (resident, placed_at)
        if last == now:
            return
        self._seen[replica] = now
        if last is not None and last[0]:
            self._held.pop(replica, None)


def capacity_blocks(cluster: ClusterSnapshot, replica: str, block_tokens: int) -> int | None:
    """How many ``block_tokens``-token blocks ``replica``'s engine can cache at most: its KV bytes
    (``EngineSnapshot.max_kv_bytes``, else its rank-0 device's capacity less its weights) over its
    KV bytes per token; None while it is evicted."""
    m = cluster.models.get(replica)
    if m is None or not m.resident:
        return None
    engine = cluster.engines.get(replica)
    if engine is not None and not engine.kv_bytes_per_token:
        return 0  # an encoder's: it keeps no KV
    if engine is not None and engine.max_kv_bytes is not None:
        tokens = engine.max_kv_bytes // engine.kv_bytes_per_token
    else:
        device = cluster.devices.get(m.placement[0])
        if device is None:
            return None
        tokens = max(0, device.capacity_bytes - m.part_weight_bytes) // m.part_kv_bytes_per_token
    return tokens // block_tokens
