"""A simulated engine: the live engine's scheduler (engine/scheduler.py) on counts instead of tensors.

Each step takes every running request first (one token per decode, the next chunk of a prefill in
progress), then waiting requests while the token budget, ``max_num_seqs`` and KV blocks last; a
running request that cannot get a block preempts the newest running one, which goes back to the
front of the waiting queue and is recomputed from its prompt plus the tokens it already produced.
New work is admitted only in steps that preempted nothing. Blocks come from the device ledger
(``memory.SimDevice``) on every device of the model's tensor-parallel group.

Speed: a step in which every scheduled request decodes and nothing was preempted is stretched into
a *run* of up to ``max_run_steps`` identical-shaped steps, ending no later than the first request's
last token (tests/sim/test_engine_parity.py: the same steps as one at a time). Its
blocks are granted up front, so between its start and its end the engine may hold up to
``max_run_steps`` tokens per request of KV that the live engine would map step by step (2 blocks at
the defaults); a dispatch or memory freed elsewhere on the device cuts the run at the next step
boundary, and the blocks not needed then are returned. Step durations inside a run come from the
cost model one by one (contexts grow every step), so a run's timing equals its steps' timings.

Prefix caching (``prefix_caching=True``; requests with ``block_keys``, workload/prefix.py), as the
live engine does it: a waiting request takes the longest run of its leading blocks that the engine's
``PrefixCache`` holds (at most ``prompt - 1`` tokens, so its last token is computed) and prefills
only the rest; its step still pays attention over the whole context. Blocks held by running
requests are shared (counted once); a full prompt block joins the cache once computed (unless two
requests computed it at once: the second copy stays private), and blocks no request holds
(finished, preempted) stay cached, least recently freed evicted first. Those free blocks live in
memory nobody has mapped: at most as many as the engine could still be granted (device pages and
quota), so a grant never waits for them; whenever the free memory shrinks (a grant of any engine on
the device, weights mapped, a smaller quota) the cache evicts what no longer fits. Stopping the
engine (an eviction) empties it; the simulator keeps its hottest keys for the model's next engine
(``PrefixCache.hottest``/``adopt``), as the live runtime does.

KV groups (``kv_groups``: engine/kv_cache.py ``KVGroups``, for a model whose sliding-window layers
sit beside full-context ones): a block is one group's layers, a request's run of ``block_size``
tokens takes one block in every group, and before each step its windowed groups free the blocks no
later query reads, as the live scheduler's ``_slide``. With the prefix cache, a cached run's
full-context blocks are what the cache shares; its windowed blocks stay each request's own (those
of a cached prefix that the request's window still reads are granted again at a hit). An encoder
keeps no KV (``ModelShape.engine_kv_bytes_per_token``) and is fed each input whole.
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

from prism_serve.control.types import Request, split_kv_bytes
from prism_serve.engine.grouping import padded_decode_context
from prism_serve.engine.kv_cache import KVGroups
from prism_serve.sim.cost import RooflineCostModel
from prism_serve.sim.memory import SimDevice
from prism_serve.sim.models import ServedModel
from prism_serve.sim.prefix_cache import PrefixCache
from prism_serve.workload.prefix import cacheable_blocks

__all__ = ["SimEngine", "SimRequest", "SimSeq"]


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's life in the simulator (times in simulated seconds)."""

    req_id: str
    model: str
    arrival: float
    prompt_tokens: int
    output_tokens: int
    ttft_slo: float
    tpot_slo: float
    control: Request = field(repr=False)
    first_token: float | None = None
    finish: float | None = None
    rejected: str | None = None  # RejectReason value
    num_preemptions: int = 0
    num_restarts: int = 0  # engine stopped under it (evicted or migrated) and it started over
    cold: bool = False  # its model had no ready engine when it arrived (evicted or still activating)
    replica: str = ""  # the replica (model or replica slot name) it was last dispatched to
    block_keys: tuple[int, ...] = field(default=(), repr=False)  # its full prompt blocks' cache keys
    cached_tokens: int | None = None  # prompt tokens found cached when first scheduled (None: never)
    group: int = -1  # the client request it is an input of (Workload.groups); -1: alone

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.finish is None or self.first_token is None:
            return None
        return (self.finish - self.first_token) / max(1, self.output_tokens - 1)


class SimSeq:
    __slots__ = (
        "cached",
        "generated",
        "keys",
        "num_blocks",
        "num_computed",
        "num_registered",
        "num_tokens",
        "req",
        "window_start",
    )

    def __init__(self, req: SimRequest) -> None:
        self.req = req
        self.keys = req.block_keys
        self.generated = 0
        self.num_tokens = req.prompt_tokens
        self.num_computed = 0
        self.num_blocks = 0  # its block table's length
        self.cached: list[int] = []  # keys of its blocks held through the prefix cache (shared)
        self.num_registered = 0  # its leading blocks the cache has seen (matched or registered)
        self.window_start = 0  # its windowed groups' leading blocks freed (KVGroups.first_read)


class SimEngine:
    """One model's engine on its devices (rank 0 first)."""

    def __init__(
        self,
        model: ServedModel,
        devices: list[SimDevice],
        cost: RooflineCostModel,
        *,
        block_size: int,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_run_steps: int,
        quota: int | None = None,
        changed: dict[str, None] | None = None,
        prefix_caching: bool = False,
        kv_groups: KVGroups | None = None,
    ) -> None:
        self.model = model
        self.name = model.name
        self.changed = changed  # where it writes its name when it turns dirty (see ``dirty``)
        self._claim_key = f"{self.name}#prompts"  # its devices' claim for prompts not yet scheduled
        self.devices = devices
        self.cost = cost
        self.block_size = block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_run_steps = max_run_steps
        self.quota = quota  # KV bytes per device, None: no cap
        # what the serving path adds to a request's first token and finish outside the engine
        self._reply_s = cost.hw.request_overhead_s
        kvpt = -(-model.spec.engine_kv_bytes_per_token // model.tp_size)  # per device, every layer
        # KV groups (engine/kv_cache.py KVGroups): a block here is ``block_size`` tokens of one
        # group's layers, as the live engine's; a token run takes ``_units`` of them, ``_shared`` of
        # the full-context groups (cached and shared by prefix) and ``_own`` of the windowed ones
        # (each request's own, freed as its window passes: ``_slide``). One group: 1, 1, 0.
        groups = kv_groups if kv_groups is not None and kv_groups.splits else None
        self.groups = groups
        self.kv_bytes_per_token, self.kv_window = (
            groups.kv_split(kvpt, max_num_batched_tokens, block_size) if groups else (kvpt, None)
        )
        if groups is None:
            self._shared, self._own = 1, 0
            self.block_bytes = kvpt * block_size
        else:
            self._own = sum(groups.windowed)
            self._shared = groups.num_groups - self._own
            self.block_bytes = kvpt * groups.layers_per_group // len(groups.group_of) * block_size
        self._units = self._shared + self._own
        self.used_blocks = 0  # blocks mapped for running requests (a shared block once)
        # an encoder keeps no KV (nothing to cache) and reads each input whole, never in chunks
        self.whole_inputs = model.spec.config.encoder
        self.cache = PrefixCache() if prefix_caching and not self.whole_inputs else None
        if self.cache is not None:
            for d in devices:
                d.shrink_watchers[self.name] = self.trim_cache
        self.running: list[SimSeq] = []
        self.waiting: deque[SimSeq] = deque()
        # the step (or run of decode steps) in flight
        self.busy = False
        self.version = 0  # bumps when the in-flight step's end moves; stale StepDone events are dropped
        self.start = 0.0
        self.end = 0.0
        self._scheduled: list[tuple[SimSeq, int]] = []
        self.first_tokens: list[SimRequest] = []  # those the last step sampled a first token for
        self._run_k = 0  # > 0: a decode run of that many steps
        self._cum: list[float] | None = None  # when a run's steps end, alone on its devices
        self._work = 0.0  # a single step's time alone on its devices
        # Compute sharing: the in-flight step runs ``factor`` times slower than alone (the simulator
        # sets it from the busy engines on the device, hardware.share_slowdown); ``start`` is the
        # virtual start such that ``end = start + work * factor`` (rescale keeps work done).
        self.factor = 1.0
        self.shared = False  # counted among its devices' busy engines (the simulator's bookkeeping)
        self.num_steps = 0
        self.num_preemptions = 0
        self._preempted = False  # the step being scheduled preempted (so it admitted nothing)
        self.dirty = True

    @property
    def dirty(self) -> bool:
        """Anything EngineSnapshot reports changed since the simulator last read it; turning dirty
        writes the engine's name into ``changed`` (the snapshot builder's list of engines to read)."""
        return self._dirty

    @dirty.setter
    def dirty(self, value: bool) -> None:
        self._dirty = value
        if value and self.changed is not None:
            self.changed[self.name] = None

    # -- requests ----------------------------------------------------------------------------------

    @property
    def num_requests(self) -> int:
        return len(self.running) + len(self.waiting)

    def add(self, req: SimRequest) -> None:
        self.dirty = True
        self.waiting.append(SimSeq(req))
        self._update_claim()

    def drop_all(self) -> list[SimRequest]:
        """Stop the engine: free every block and hand back its unfinished requests."""
        out = [s.req for s in self.running] + [s.req for s in self.waiting]
        self.dirty = True
        self.running.clear()
        self.waiting.clear()
        self.used_blocks = 0
        if self.cache is not None:
            self.cache.clear()  # what is kept across the eviction the simulator took before
        for d in self.devices:
            d.set_kv(self.name, 0)
            d.claim(self._claim_key, 0)
            d.shrink_watchers.pop(self.name, None)
        self.busy = False
        self.version += 1
        return out

    def kv_bytes(self, tokens: int) -> int:
        """KV bytes a request of ``tokens`` tokens holds at most (EngineSnapshot.kv_bytes)."""
        return split_kv_bytes((self.kv_bytes_per_token, self.kv_window), tokens)

    def _update_claim(self) -> None:
        # prompts dispatched but not yet holding blocks: promised memory (see memory.py)
        if self.kv_window is None:
            need = sum(s.num_tokens + 1 for s in self.waiting) * self.kv_bytes_per_token
        else:
            need = sum(self.kv_bytes(s.num_tokens + 1) for s in self.waiting)
        for d in self.devices:
            d.claim(self._claim_key, need)

    def claimed_bytes(self) -> int:
        return self.devices[0].claims.get(self._claim_key, 0)

    # -- blocks --------------------------------------------------------------------------------

    def _fits(self, extra: int) -> bool:
        """Whether ``extra`` more blocks can be granted on every device now."""
        new_bytes = (self.used_blocks + extra) * self.block_bytes
        if self.quota is not None and new_bytes > self.quota:
            return False
        return all(d.kv_delta_pages(self.name, new_bytes) <= d.free_pages for d in self.devices)

    def _try_blocks(self, extra: int) -> bool:
        """Grant ``extra`` more blocks on every device, or nothing."""
        if extra <= 0:
            return True
        if not self._fits(extra):
            return False
        self.used_blocks += extra
        self.dirty = True
        new_bytes = self.used_blocks * self.block_bytes
        for d in self.devices:
            d.set_kv(self.name, new_bytes)
        if self.cache is not None:  # within pages it had mapped no device shrank: trim here
            self.trim_cache()
        return True

    def _return_blocks(self, n: int) -> None:
        if n:
            self.used_blocks -= n
            self.dirty = True
            for d in self.devices:
                d.set_kv(self.name, self.used_blocks * self.block_bytes)

    def _grow(self, seq: SimSeq, num_tokens: int) -> bool:
        if self.groups is not None:
            self._slide(seq)
        need = -(-num_tokens // self.block_size) - seq.num_blocks
        if need <= 0:
            return True
        if not self._try_blocks(need * self._units):
            return False
        seq.num_blocks += need
        return True

    def _slide(self, seq: SimSeq) -> None:
        """Free its windowed groups' blocks that no query from its next token on reads."""
        first = min(self.groups.first_read(seq.num_computed, self.block_size), seq.num_blocks)
        if first > seq.window_start:
            self._return_blocks((first - seq.window_start) * self._own)
            seq.window_start = first

    def held_blocks(self, seq: SimSeq) -> int:
        """Blocks ``seq`` holds (those shared through the prefix cache included)."""
        return seq.num_blocks * self._units - seq.window_start * self._own

    def _release(self, seq: SimSeq) -> None:
        n = self.held_blocks(seq)
        if seq.cached:  # shared ones go back to the cache; those no one holds now free memory
            n += (self.cache.release(seq.cached) - len(seq.cached)) * self._shared
            seq.cached = []
        seq.num_registered = 0
        self._return_blocks(n)
        seq.num_blocks = seq.window_start = 0

    # -- prefix cache ----------------------------------------------------------------------------

    @property
    def cached_block_bytes(self) -> int:
        """Bytes of one prefix-cache entry: a token run's full-context blocks."""
        return self.block_bytes * self._shared

    def cache_room(self) -> int:
        """Cache entries the engine could still be granted now: the most free ones it keeps."""
        bb = self.block_bytes
        room = min((d.kv_pages.get(self.name, 0) + d.free_pages) * d.page_size // bb for d in self.devices)
        if self.quota is not None:
            room = min(room, self.quota // bb)
        return max(0, room - self.used_blocks) // self._shared

    def trim_cache(self) -> None:
        """Evict the free cached blocks that no longer fit in the memory the engine could be granted."""
        excess = self.cache.num_free - self.cache_room()
        if excess > 0:
            self.cache.evict(excess)

    def set_quota(self, quota: int | None) -> None:
        self.quota = quota
        self.dirty = True
        if self.cache is not None:
            self.trim_cache()

    def _admit(self, seq: SimSeq, budget: int) -> int | None:
        """Take a waiting ``seq``'s cached prefix and the blocks for its first chunk; the tokens it
        computes this step, or None (nothing changed) when the blocks cannot be granted."""
        bs = self.block_size
        hit = free = 0
        if self.cache is not None and seq.keys:
            hit, free = self.cache.match(seq.keys, cacheable_blocks(seq.num_tokens, bs))
        start = hit * bs
        n = min(seq.num_tokens - start, budget)
        need = -(-(start + n) // bs) - hit
        # the free cached blocks it takes are counted as in use again: granted with its new ones;
        # a windowed group's blocks are its own, those of the cached prefix its window still reads
        first = 0 if self.groups is None else min(self.groups.first_read(start, bs), hit)
        units = free * self._shared + need * self._units + (hit - first) * self._own
        if not self._fits(units):
            return None
        if hit:
            seq.cached = list(seq.keys[:hit])
            self.cache.acquire(seq.cached)
        self._try_blocks(units)
        seq.num_blocks, seq.num_registered, seq.num_computed = hit + need, hit, start
        seq.window_start = first
        if seq.req.cached_tokens is None:
            seq.req.cached_tokens = start
        return n

    def _register(self, seq: SimSeq) -> None:
        """Its prompt blocks computed in full join the cache (but for copies of cached ones)."""
        full = min(seq.num_computed // self.block_size, len(seq.keys))
        for key in seq.keys[seq.num_registered : full]:
            if self.cache.register(key):
                seq.cached.append(key)
        seq.num_registered = max(seq.num_registered, full)

    # -- one step ------------------------------------------------------------------------------

    def _schedule(self) -> list[tuple[SimSeq, int]]:
        scheduled: list[tuple[SimSeq, int]] = []
        budget = self.max_num_batched_tokens
        preempted = False
        running = self.running
        bs = self.block_size
        i = 0
        groups = self.groups
        while i < len(running) and budget > 0:
            seq = running[i]
            if groups is not None:
                self._slide(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if -(-(seq.num_computed + n) // bs) <= seq.num_blocks:
                # it holds the blocks already (a decode run granted them): _grow's first test, inline
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            while not self._grow(seq, seq.num_computed + n):
                victim = running.pop()
                self._release(victim)
                victim.num_computed = 0
                victim.req.num_preemptions += 1
                self.num_preemptions += 1
                self.waiting.appendleft(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break
        self._preempted = preempted
        while not preempted and self.waiting and budget > 0 and len(running) < self.max_num_seqs:
            seq = self.waiting[0]
            if self.cache is not None:
                n = self._admit(seq, budget)
                if n is None:
                    break
            else:
                n = min(seq.num_tokens - seq.num_computed, budget)
                if self.whole_inputs and n < seq.num_tokens <= self.max_num_batched_tokens:
                    break  # an encoder's input is read in one step: the next has room for it
                if not self._grow(seq, seq.num_computed + n):
                    break
            self.waiting.popleft()
            running.append(seq)
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    def start_step(self, now: float, factor: float = 1.0) -> float | None:
        """Schedule the next step (or decode run) at ``now``, running ``factor`` times slower than
        alone (compute shared with other engines); its end time, or None if idle."""
        scheduled = self._schedule()
        self.dirty = True
        self._update_claim()
        if not scheduled:
            self.busy = False
            return None
        spec, tp = self.model.spec, self.model.tp_size
        self.busy = True
        self.version += 1
        self.start = now
        self.factor = factor
        self._scheduled = scheduled
        self._cum = None
        self._run_k = 0
        # generated > 0: a prefill whose last chunk is one token also feeds exactly one token
        decoding = all(n == 1 and s.generated and s.num_computed == s.num_tokens - 1 for s, n in scheduled)
        if decoding:
            k = min(self.max_run_steps, min(s.req.output_tokens - s.generated for s, _ in scheduled))
            k = self._grant_run(k)
            if self.cost.hw.pad_decode_context:
                context = padded_decode_context([s.num_computed + 1 for s, _ in scheduled]) - len(scheduled)
            else:
                context = sum(s.num_computed for s, _ in scheduled)
            self._cum = self.cost.decode_run(spec, tp, len(scheduled), context, k)
            self._run_k = k
            self.end = now + self._cum[-1] * factor
            return self.end
        tokens = 0
        pairs = 0.0
        kv_read = 0
        sampling = 0
        pad = self.cost.hw.pad_decode_context  # decodes read their group's longest context (hardware.py)
        decodes = []
        for s, n in scheduled:
            tokens += n
            sampling += s.num_computed + n == s.num_tokens
            if pad and n == 1:
                decodes.append(s.num_computed + 1)
                continue
            pairs += n * (s.num_computed + (n + 1) / 2)
            kv_read += s.num_computed
        if decodes:  # a decode of context b costs b + 1 pairs and b KV reads, b padded
            padded = padded_decode_context(decodes)
            pairs += padded
            kv_read += padded - len(decodes)
        self._work = self.cost.step_time(spec, tp, tokens, pairs, kv_read, sampling)
        self.end = now + self._work * factor
        return self.end

    def _grant_run(self, k: int) -> int:
        """The longest run (<= k steps) whose blocks can all be granted now; 1 is already granted.
        A step that preempted is not stretched: the next step may admit what it sent back."""
        if self._preempted:
            return 1
        while k > 1:
            bs = self.block_size
            extra = sum(-(-(s.num_computed + k) // bs) - s.num_blocks for s, _ in self._scheduled)
            if self._try_blocks(extra * self._units):
                for s, _ in self._scheduled:
                    s.num_blocks = -(-(s.num_computed + k) // bs)
                return k
            k //= 2
        return 1

    def cut(self, now: float) -> float | None:
        """End a decode run at the first step boundary at or after ``now``; the new end, or None if
        nothing changed (a single step, or the run ends by then anyway)."""
        if not self.busy or self._run_k <= 1 or now >= self.end:
            return None
        j = bisect_left(self._cum, (now - self.start) / self.factor)
        k = j + 1
        if k >= self._run_k:
            return None
        bs = self.block_size
        extra = 0
        for s, _ in self._scheduled:
            keep = -(-(s.num_computed + k) // bs)
            extra += s.num_blocks - keep
            s.num_blocks = keep
        self._return_blocks(extra * self._units)
        self._run_k = k
        self.end = self.start + self._cum[j] * self.factor
        self.version += 1
        return self.end

    def rescale(self, now: float, factor: float) -> float | None:
        """From ``now`` on, run the step in flight ``factor`` times slower than alone (processor
        sharing: the work done so far is kept); the new end, or None if nothing changed."""
        if not self.busy or factor == self.factor or now >= self.end:
            return None
        done = (now - self.start) / self.factor  # work done so far, in seconds alone
        work = self.work_alone
        self.start = now - done * factor
        self.factor = factor
        self.end = self.start + work * factor
        self.version += 1
        return self.end

    @property
    def work_alone(self) -> float:
        """Seconds the step or run in flight takes alone on its devices (0.0 when idle)."""
        if not self.busy:
            return 0.0
        return self._cum[self._run_k - 1] if self._run_k else self._work

    @property
    def decode_shape(self) -> tuple[int, int, float]:
        """(sequences, steps, seconds alone on its devices) of the decode step or run in flight;
        (0, 0, 0.0) for a step with a prefill."""
        if self._cum is None:
            return 0, 0, 0.0
        return len(self._scheduled), self._run_k, self._cum[self._run_k - 1]

    def finish_step(self, now: float) -> tuple[list[SimRequest], bool]:
        """Apply the step that ends at ``now``: (requests finished, whether blocks were freed); the
        requests whose first token it sampled are in ``first_tokens`` until the next step ends."""
        self.busy = False
        self.dirty = True
        finished: list[SimRequest] = []
        self.first_tokens = first = []
        k = self._run_k
        if k:
            self.num_steps += k
            for s, _ in self._scheduled:
                s.num_computed += k
                s.generated += k
                s.num_tokens += k
        else:
            self.num_steps += 1
            cache = self.cache
            for s, n in self._scheduled:
                s.num_computed += n
                if cache is not None and s.num_registered < len(s.keys):
                    self._register(s)
                if s.num_computed == s.num_tokens:
                    s.generated += 1
                    s.num_tokens += 1
                    if s.req.first_token is None:
                        s.req.first_token = now + self._reply_s
                        first.append(s.req)
        freed = False
        for s, _ in self._scheduled:
            if s.generated >= s.req.output_tokens:
                s.req.finish = now + self._reply_s
                finished.append(s.req)
                self.running.remove(s)
                if s.num_blocks:
                    freed = True
                self._release(s)
        self._scheduled = []
        self._run_k = 0
        self._cum = None
        return finished, freed
