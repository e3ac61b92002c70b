"""Prefix caching. On block ids alone: matching, sharing, LRU reuse, and that a rewritten block is
never served for its old content (hypothesis drives random interleavings against a model of it).
In the engine with the real SmolLM2 (fp32): interleaved requests over shared prefixes, with aborts,
n > 1 and preemptions, give the tokens and logprobs of an engine without the cache."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.engine.kv_cache import KVGroups
from prism_serve.engine.prefix_cache import PrefixCache, block_keys
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.scheduler import Scheduler
from prism_serve.engine.sequence import RequestMetrics, RequestOutput, Sequence, SequenceStatus
from prism_serve.memory.blocks import FixedBlockAllocator
from tests.conftest import run_to_completion

BS = 4


def keys_of(tokens: list[int], salt: bytes = b"") -> list[bytes]:
    return block_keys(tokens, BS, salt, [])


def test_keys_chain_over_the_prefix_and_the_salt() -> None:
    a = keys_of([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert len(a) == 2  # full blocks only
    b = keys_of([0, 2, 3, 4, 5, 6, 7, 8])
    assert a[1] != b[1]  # same second block after a different first: another prefix
    assert keys_of([1, 2, 3, 4, 5, 6, 7, 8]) == a
    assert keys_of([1, 2, 3, 4], salt=b"adapter") != a[:1]
    # extending keeps what was there and adds the new full blocks
    part = keys_of([1, 2, 3, 4])
    assert block_keys([1, 2, 3, 4, 5, 6, 7, 8], BS, b"", part) == a


def test_match_takes_the_longest_registered_run_and_leaves_the_last_token() -> None:
    cache = PrefixCache(FixedBlockAllocator(8), BS)
    tokens = list(range(12))
    table = cache.allocate(3)
    assert table is not None
    cache.register(keys_of(tokens), table, 0, len(table))
    # the same 12 tokens: at most 11 may come from the cache, so two blocks
    assert cache.match(keys_of(tokens), len(tokens)) == table[:2]
    # 13 tokens sharing all three blocks: three
    longer = [*tokens, 99]
    assert cache.match(keys_of(longer), len(longer)) == table
    # a prompt that differs in its second block takes the first only
    other = [*tokens[:4], 50, 51, 52, 53, *tokens[8:], 1]
    assert cache.match(keys_of(other), len(other)) == table[:1]
    assert cache.stats().hits == (2 + 3 + 1) * BS


def test_registered_blocks_outlive_their_request_least_recent_first() -> None:
    alloc = FixedBlockAllocator(4)
    cache = PrefixCache(alloc, BS)
    a, b = list(range(8)), list(range(100, 108))
    ta, tb = cache.allocate(2), cache.allocate(2)
    cache.register(keys_of(a), ta, 0, len(ta))
    cache.register(keys_of(b), tb, 0, len(tb))
    cache.free(ta)
    cache.free(tb)
    assert alloc.num_free_blocks == 0 and cache.num_evictable_blocks == 4
    # the allocator is empty: new content takes the oldest unheld block, a's last block first
    got = cache.allocate(1)
    assert got == [ta[1]]
    cache.free(got)
    assert alloc.num_free_blocks == 1  # never registered: straight back to the allocator
    assert cache.match(keys_of([*a, 0]), 9) == ta[:1]  # a's first block is still there
    cache.free(ta[:1])
    # two more: one from the allocator, one cached block (the oldest now: b's last), no more
    got = cache.allocate(2)
    assert sorted(got) == sorted([ta[1], tb[1]]) and cache.num_evictable_blocks == 2
    assert cache.match(keys_of([*b, 0]), 9) == tb[:1]


def test_shared_blocks_are_counted_and_never_freed_while_held() -> None:
    alloc = FixedBlockAllocator(4)
    cache = PrefixCache(alloc, BS)
    tokens = list(range(9))
    table = cache.allocate(2)
    cache.register(keys_of(tokens), table, 0, len(table))
    held = cache.match(keys_of(tokens), len(tokens))
    assert held == table
    cache.free(table)  # the first holder ends: the second still reads them
    assert cache.num_evictable_blocks == 0
    assert cache.allocate(3) is None  # 2 free in the allocator, nothing evictable
    cache.free(held)
    assert cache.num_evictable_blocks == 2
    assert sorted(cache.allocate(4)) == [0, 1, 2, 3]
    with pytest.raises(RuntimeError):
        cache.free([5])  # foreign


def test_drop_gives_unheld_blocks_back_to_the_allocator() -> None:
    alloc = FixedBlockAllocator(4)
    cache = PrefixCache(alloc, BS)
    table = cache.allocate(3)
    cache.register(keys_of(list(range(12))), table, 0, len(table))
    cache.free(table)
    assert alloc.num_free_blocks == 1
    assert cache.drop(2) == [table[2], table[1]]
    assert alloc.num_free_blocks == 3 and cache.num_evictable_blocks == 1
    assert cache.match(keys_of(list(range(12))), 12) == table[:1]


def test_a_duplicate_block_stays_private() -> None:
    alloc = FixedBlockAllocator(4)
    cache = PrefixCache(alloc, BS)
    tokens = list(range(4))
    t1, t2 = cache.allocate(1), cache.allocate(1)  # two requests computed the same block at once
    cache.register(keys_of(tokens), t1, 0, len(t1))
    cache.register(keys_of(tokens), t2, 0, len(t2))
    cache.free(t2)
    assert alloc.num_free_blocks == 3  # the duplicate went back
    cache.free(t1)
    assert cache.num_evictable_blocks == 1


# ---- random interleavings against a model --------------------------------------------------------

ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 3), st.integers(1, 14)),  # prefix id, length
        st.tuples(st.just("grow"), st.integers(0, 7), st.integers(1, 6)),
        st.tuples(st.just("end"), st.integers(0, 7), st.just(0)),
        st.tuples(st.just("drop"), st.integers(0, 3), st.just(0)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops)
def test_random_interleavings_never_serve_stale_or_shared_writes(script) -> None:
    """Requests start (matching what is cached), grow (writing new tokens into blocks of their
    own), end (freeing) and the device asks for memory back (drop), in any order. A fake KV records
    what each block holds: every block a request matches must hold exactly the tokens it hashed,
    no block is written while another request holds it, and every block is accounted for once."""
    num_blocks = 10
    alloc = FixedBlockAllocator(num_blocks)
    cache = PrefixCache(alloc, BS)
    kv: dict[int, tuple[int, ...]] = {}  # block -> the tokens written into it
    live: list[dict] = []  # each: tokens, table, computed, registered
    prefixes = [[p * 1000 + i for i in range(20)] for p in range(4)]

    def write(req: dict, upto: int) -> bool:
        need = -(-upto // BS) - len(req["table"])
        if need > 0:
            got = cache.allocate(need)
            if got is None:
                return False
            for b in got:  # handed out for new content: nobody may hold it
                assert all(b not in r["table"] for r in live)
                kv[b] = ()
            req["table"].extend(got)
        for pos in range(req["computed"], upto):
            b = req["table"][pos // BS]
            assert kv[b] == tuple(req["tokens"][pos - pos % BS : pos]), "writes only after what is there"
            kv[b] = kv[b] + (req["tokens"][pos],)
        req["computed"] = upto
        full = upto // BS
        keys = block_keys(req["tokens"][: full * BS], BS, b"", [])
        req["registered"] = cache.register(keys, req["table"], req["registered"], full)
        return True

    for op, a, n in script:
        if op == "start":
            tokens = prefixes[a][:n] + [7] * (a % 2)
            keys = block_keys(tokens, BS, b"", [])
            table = cache.match(keys, len(tokens))
            for i, b in enumerate(table):
                assert kv[b] == tuple(tokens[i * BS : (i + 1) * BS]), "a cached block holds other tokens"
            req = {"tokens": tokens, "table": table, "computed": len(table) * BS, "registered": len(table)}
            live.append(req)
            if not write(req, len(tokens)):
                cache.free(req["table"])
                live.remove(req)
        elif op == "grow" and live:
            req = live[a % len(live)]
            req["tokens"] = req["tokens"] + [9000 + a] * n
            if not write(req, len(req["tokens"])):
                cache.free(req["table"])  # preempted
                live.remove(req)
        elif op == "end" and live:
            req = live.pop(a % len(live))
            cache.free(req["table"])
        elif op == "drop":
            cache.drop(a)
        held = {b for r in live for b in r["table"]}
        shared = [b for b in held if sum(r["table"].count(b) for r in live) > 1]
        assert all(b in cache._key_of for b in shared), "only registered blocks are shared"
        assert len(held) + cache.num_evictable_blocks + alloc.num_free_blocks == num_blocks
    for req in live:
        cache.free(req["table"])
    cache.drop()
    assert alloc.num_free_blocks == num_blocks


class _Refusing(FixedBlockAllocator):
    """A fixed pool whose grants are also refused at random, as a device ledger refuses them when
    a neighbour holds the memory."""

    def __init__(self, num_blocks: int, rng: random.Random) -> None:
        super().__init__(num_blocks)
        self.rng = rng

    def allocate(self, num_blocks: int) -> list[int] | None:
        return None if self.rng.random() < 0.2 else super().allocate(num_blocks)


def test_kv_groups_split_full_context_layers_from_windowed_ones() -> None:
    """Gemma 3 1B (4 global layers of 26): 1 + 6 groups of 4 layers, the last windowed group
    padded by 2; Gemma 2 2B (every other layer windowed): 2 groups of 13; Mistral v0.1 (one window
    everywhere) and Llama (none): one group of every layer; a window no shorter than the context
    served hides nothing, so it is no group of its own."""
    from prism_serve.engine.models.config import PRESETS

    g3 = KVGroups.of(PRESETS["gemma-3-1b"])
    assert (g3.layers_per_group, g3.num_groups, g3.window) == (4, 7, 512)
    assert g3.windowed == (False, *[True] * 6)
    assert [i for i, g in enumerate(g3.group_of) if g == 0] == [5, 11, 17, 23]
    assert len(set(zip(g3.group_of, g3.slot_of, strict=True))) == 26  # one place in a block each
    g2 = KVGroups.of(PRESETS["gemma-2-2b"])
    assert (g2.layers_per_group, g2.windowed) == (13, (False, True))
    mistral = KVGroups.of(dataclasses.replace(PRESETS["gemma-2-2b"], global_layers=()))
    assert (mistral.layers_per_group, mistral.windowed) == (26, (True,))
    assert KVGroups.of(PRESETS["smollm2-135m"]).windowed == (False,)
    assert KVGroups.of(PRESETS["gemma-3-1b"], 512).windowed == (False,)
    # a block per group for each run of tokens; a windowed group holds its window and a chunk
    assert g3.max_blocks(4096, 16, 256) == 256 + 6 * ((511 + 256) // 16 + 2)
    assert g3.first_read(600, 16) == (600 - 511) // 16


def test_a_windowed_group_matches_only_the_blocks_the_next_query_reads() -> None:
    """A 6-block prefix cached in a full-context group and two windowed ones (window 6, blocks of
    4), whose windowed groups lost their first 4 blocks: a 26-token prompt matches all 6 blocks
    (the next query, at position 24, reads from position 19: blocks 4 and 5), with the windowed
    tables starting at block 4; a 13-token prompt, whose next query would read the lost blocks,
    matches nothing and holds nothing."""
    alloc = FixedBlockAllocator(64)
    cache = PrefixCache(alloc, BS)
    groups = _groups(_SPLIT, 6)
    tokens = list(range(24))
    keys = keys_of(tokens)
    tables = [alloc.allocate(6) for _ in groups.windowed]
    for group, table in enumerate(tables):
        cache.register(keys, table, 0, 6, b"", group)
    cache.free(tables[1][:4] + tables[2][:4])  # the windowed groups' window moved on
    cache.free(tables[0] + tables[1][4:] + tables[2][4:])  # the request ends
    assert sorted(cache.drop(8)) == sorted(tables[1][:4] + tables[2][:4])
    got, first = cache.match_groups(keys_of([*tokens, 99, 98]), 26, groups)
    assert first == 4 and got == [tables[0], [-1] * 4 + tables[1][4:], [-1] * 4 + tables[2][4:]]
    assert cache.num_evictable_blocks == 0  # all held by the match
    cache.free(got[0] + got[1][4:] + got[2][4:])
    assert cache.match_groups(keys_of(tokens[:13]), 13, groups) == ([[], [], []], 0)
    assert cache.num_evictable_blocks == 10


# KV groups of a 3-layer model: one full-context layer and two windowed ones (Gemma's split), and
# one windowed group of every layer (Mistral v0.1's window)
_SPLIT = (False, True, True)
_ALL_WINDOWED = (True,)


def _groups(windowed: tuple[bool, ...], window: int) -> KVGroups:
    n = len(windowed)
    return KVGroups(1, tuple(range(n)), (0,) * n, windowed, window)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1))
def test_the_scheduler_over_the_cache_never_loses_or_doubles_a_block(seed: int) -> None:
    """The scheduler's own loop (no model: each chunk is "computed" as the engine's postprocess
    counts it) over long shared prompts with chunked prefill, refusals, preemption, aborts and the
    device taking cached blocks back, with the cache or without, for a model of one KV group or of
    several with sliding windows: no block is ever in one table twice, a block in two tables is a
    registered one, every block is held, cached or free, once, and a windowed group holds no more
    than its window and a step's chunk."""
    rng = random.Random(seed)
    groups = rng.choice([None, None, _groups(_SPLIT, rng.choice([1, 5, 9, 30])), _groups(_ALL_WINDOWED, 7)])
    num_groups = 1 if groups is None else groups.num_groups
    num_blocks = rng.randint(6, 40) * num_groups
    alloc = _Refusing(num_blocks, rng)
    cache = PrefixCache(alloc, BS) if rng.random() < 0.8 else None
    budget = rng.choice([8, 16, 64])
    sched = Scheduler(alloc, BS, rng.choice([1, 2, 4, 8]), budget, None, cache, groups=groups)
    evictable = (lambda: 0) if cache is None else (lambda: cache.num_evictable_blocks)
    prefixes = [[rng.randrange(50) for _ in range(90)] for _ in range(3)]
    live: list[Sequence] = []
    for step in range(120):
        if rng.random() < 0.4:
            prompt = rng.choice(prefixes)[: rng.randint(3, 90)] + [
                rng.randrange(50) for _ in range(rng.randint(0, 3))
            ]
            seq = Sequence(
                f"r{step}", prompt, SamplingParams(max_tokens=rng.randint(1, 8)), None, RequestMetrics(0.0)
            )
            sched.add(seq)
            live.append(seq)
        out = sched.schedule()
        for s in out.scheduled:
            seq = s.seq
            samples = s.samples
            seq.metrics.first_scheduled_time = 0.0
            seq.num_computed_tokens += s.num_new_tokens
            sched.cache_computed(seq)
            if samples:
                seq.token_ids.append(rng.randrange(50))
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq)
        if rng.random() < 0.1 and (unfinished := [q for q in live if not q.finished]):
            sched.finish(rng.choice(unfinished))  # an abort, running or waiting
        if cache is not None and rng.random() < 0.1:
            cache.drop(rng.randint(0, 3))
        tables = []
        for q in live:
            if q.finished or not q.block_table:
                assert not any(q.group_tables)
                continue
            for windowed, t in zip(num_groups * (False,) if groups is None else groups.windowed,
                                   [q.block_table, *q.group_tables], strict=True):  # fmt: skip
                assert len(t) == len(q.block_table)
                lo = q.window_start if windowed else 0
                assert all(b == -1 for b in t[:lo]) and all(b >= 0 for b in t[lo:])
                if windowed and q.status is SequenceStatus.RUNNING:
                    assert len(t) - lo <= (groups.window - 1 + budget) // BS + 2
                tables.append(t[lo:])
        assert all(len(t) == len(set(t)) for t in tables)
        held = [b for t in tables for b in t]
        assert all(b in cache._key_of for b in held if held.count(b) > 1)
        assert len(set(held)) + evictable() + alloc.num_free_blocks == num_blocks
    for seq in live:
        if not seq.finished:
            sched.finish(seq)
    if cache is not None:
        cache.drop()
    assert alloc.num_free_blocks == num_blocks


# ---- the engine with the real SmolLM2 --------------------------------------------------------------

SYSTEM = (
    "You are a careful assistant for a shipping company. Answer in one short sentence, name the "
    "port when one is asked for, and never invent tracking numbers. "
)
QUESTIONS = [
    "Where does the ship from Rotterdam dock?",
    "How long is the route to Singapore?",
    "What is a bill of lading?",
    "Which port is busiest in Europe?",
]


@pytest.fixture(scope="module")
def chat_prompts(smollm) -> list[list[int]]:
    """Chat prompts that share a long system prompt, and a second turn of the first (its answer
    resent as history): the shapes an agent or a chat client sends."""
    tok = smollm.tokenizer
    out = [
        tok.encode(
            tok.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}])
        )
        for q in QUESTIONS
    ]
    turn = [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": QUESTIONS[0]},
        {"role": "assistant", "content": "It docks at the container terminal."},
        {"role": "user", "content": "And when?"},
    ]
    return [*out, tok.encode(tok.apply_chat_template(turn))]


@pytest.fixture(scope="module")
def reference(make_engine, chat_prompts) -> list[RequestOutput]:
    """Each prompt alone on an engine without the cache: greedy tokens and their logprobs."""
    engine = make_engine(prefix_caching=False)
    out = []
    for p in chat_prompts:
        rid = engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0))
        out.append(run_to_completion(engine)[rid])
    return out


def _same(out: RequestOutput, ref: RequestOutput) -> None:
    assert out.token_ids == ref.token_ids
    for a, b in zip(out.logprobs, ref.logprobs, strict=True):
        assert a.logprob == pytest.approx(b.logprob, abs=2e-3)


@settings(max_examples=3, deadline=None)
@given(
    order=st.permutations(range(5)),
    start=st.lists(st.integers(0, 3), min_size=5, max_size=5),  # the step each request arrives at
    abort=st.sets(st.integers(0, 4), max_size=2),
    n=st.integers(1, 2),
    num_blocks=st.sampled_from([24, 40, 256]),  # 24: preemptions; prompts are ~60 tokens, 4-token blocks
)
def test_interleaved_requests_with_the_cache_give_the_uncached_outputs(
    make_engine, chat_prompts, reference, order, start, abort, n, num_blocks
) -> None:
    """Shared prefixes arriving at different steps, some aborted mid-way, n > 1, and a KV so small
    that requests preempt each other and reuse each other's freed blocks: every request that ends
    gives the tokens and logprobs it gives alone without a cache, and nothing leaks."""
    engine = make_engine(num_kv_blocks=num_blocks, block_size=4, max_num_batched_tokens=32)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    ids: dict[str, int] = {}
    for rnd in range(2):  # a second round finds the first's blocks cached
        pending = [(start[i], i) for i in order]
        step = 0
        while pending or engine.has_unfinished_requests():
            for s, i in [p for p in pending if p[0] <= step]:
                pending.remove((s, i))
                for c in range(n):
                    ids[engine.add_request(chat_prompts[i], greedy, req_id=f"{rnd}-{i}-{c}")] = i
            outs = engine.step()
            for o in outs:
                i = ids[o.req_id]
                if i in abort and rnd == 0 and not o.finished and o.req_id.endswith("-0"):
                    engine.abort_request(o.req_id)
                elif o.finished:
                    _same(o, reference[i])
            step += 1
    cache = engine.prefix_cache
    assert cache.stats().hits > 0
    assert engine.allocator.num_free_blocks + cache.num_evictable_blocks == num_blocks


def test_a_hit_prefills_only_the_rest_and_reports_it(make_engine, chat_prompts, reference) -> None:
    engine = make_engine(block_size=16)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    first = engine.add_request(chat_prompts[0], greedy)
    out = run_to_completion(engine)[first]
    assert out.num_cached_tokens == 0
    engine.record_step_batches = True
    second = engine.add_request(chat_prompts[1], greedy)
    engine.step()
    ((new, cached, _),) = engine.last_step_batch
    shared = 0
    while chat_prompts[0][shared] == chat_prompts[1][shared]:
        shared += 1
    assert cached == shared // 16 * 16 > 0  # every full block of the shared system prompt
    assert new == len(chat_prompts[1]) - cached
    out = run_to_completion(engine)[second]
    assert out.num_cached_tokens == cached
    _same(out, reference[1])
    # the same prompt again: all of it but the last token's block
    again = engine.add_request(chat_prompts[1], greedy)
    out = run_to_completion(engine)[again]
    assert out.num_cached_tokens == (len(chat_prompts[1]) - 1) // 16 * 16
    _same(out, reference[1])


def test_prompt_logprobs_are_computed_not_taken_from_the_cache(make_engine, chat_prompts) -> None:
    """A request asking for prompt logprobs needs every prompt position's logits: it skips the
    cache (cached_tokens 0) and gets what an engine without a cache gives."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1)
    plain = make_engine(prefix_caching=False)
    plain.add_request(chat_prompts[1], params)
    want = plain.step()[0].prompt_logprobs
    run_to_completion(plain)
    engine = make_engine()
    for _ in range(2):
        engine.add_request(chat_prompts[1], params)
        first = engine.step()[0]  # prompt logprobs come whole with the first token
        assert first.num_cached_tokens == 0
        run_to_completion(engine)
        for a, b in zip(first.prompt_logprobs[1:], want[1:], strict=True):
            assert a.token_id == b.token_id and a.logprob == pytest.approx(b.logprob, abs=2e-3)
    # its blocks were registered all the same: a plain request after it hits
    rid = engine.add_request(chat_prompts[1], SamplingParams(temperature=0, max_tokens=2))
    assert run_to_completion(engine)[rid].num_cached_tokens > 0


def test_prefix_caching_off_keeps_nothing(make_engine, chat_prompts) -> None:
    engine = make_engine(prefix_caching=False)
    for _ in range(2):
        rid = engine.add_request(chat_prompts[0], SamplingParams(max_tokens=2))
        assert run_to_completion(engine)[rid].num_cached_tokens == 0
    assert engine.prefix_cache is None and engine.num_cached_blocks == 0
    assert engine.allocator.num_free_blocks == engine.allocator.num_total_blocks


# ---- prefixes kept across engines (engine/kept_prefixes.py) ------------------------------------


def test_hottest_lists_hit_prefixes_most_hits_first_then_the_rest_and_adopt_keeps_order_and_counts():
    cache = PrefixCache(FixedBlockAllocator(40), BS)
    old, new, once = list(range(12)), list(range(100, 108)), list(range(300, 308))
    adapter = list(range(200, 208))
    for tokens, salt in ((old, b""), (adapter, b"lora"), (new, b""), (once, b"")):
        table = cache.allocate(len(tokens) // BS)
        cache.register(block_keys(tokens, BS, salt, []), table, 0, len(table), salt)
        cache.free(table)

    def ask(tokens: list[int], salt: bytes = b"") -> None:  # a request with these leading tokens
        cache.free(cache.match(keys_of([*tokens, 1], salt), len(tokens) + 1))

    ask(old[:8])  # the first two blocks of old: two hits each, its third one
    ask(old)
    ask(new)  # one hit each, more recent than old's
    ask(adapter, b"lora")
    listed = cache.hottest(10)
    keys = [k for _, k, _ in listed]
    # most hits first, then the most recent; every block after its parent; then the prompt no
    # request hit (nothing adopted yet: no evidence against keeping it); the adapter's chain is not
    # listed (its salt names a registration in this engine only)
    assert keys == keys_of(old)[:2] + keys_of(new) + keys_of(old)[2:] + keys_of(once)
    assert [p for _, _, p in listed][:5] == [b"", keys_of(old)[0], b"", keys_of(new)[0], keys_of(old)[1]]
    assert [cache.hits_of(b) for b, _, _ in listed] == [2, 2, 1, 1, 1, 0, 0]
    assert [k for _, k, _ in cache.hottest(3)] == keys_of(old)[:2] + keys_of(new)[:1]  # cut: still prefixes

    fresh = PrefixCache(FixedBlockAllocator(4), BS)  # room for 4 of the 7 listed
    hits = [cache.hits_of(b) for b, _, _ in listed]
    taken = fresh.adopt(keys, [p for _, _, p in listed], hits)
    assert [i for i, _ in taken] == [0, 1, 2, 3] and fresh.num_evictable_blocks == 4  # the leading 4
    # the counts come along: kept again at the next eviction with no new hit, in the same order
    assert [k for _, k, _ in fresh.hottest(10)] == keys[:4]
    assert len(fresh.match(keys_of([*new, 1]), len(new) + 1)) == 2  # a hit: the whole new prefix
    # an entry whose parent was not adopted is skipped, its block given back
    orphan = PrefixCache(FixedBlockAllocator(8), BS)
    assert [i for i, _ in orphan.adopt(keys[3:5], [p for _, _, p in listed][3:5])] == []
    assert orphan.allocator.num_free_blocks == 8


def test_blocks_no_request_hit_are_kept_while_the_last_return_shows_them_asked_for_again():
    """Prompts seen once (each block computed for one request) are all kept at a first eviction,
    and after a return that served nothing; a return that serves requests and hits none of them
    keeps, at the next, only the most recent request's first block (and every block hit); a return
    that hits one of them keeps them all again."""

    def serve(cache: PrefixCache, prompts: list[list[int]]) -> None:
        for tokens in prompts:
            got = cache.match(keys_of([*tokens, 1]), len(tokens) + 1)
            n = len(tokens) // BS
            table = got + cache.allocate(n - len(got))
            cache.register(keys_of(tokens), table, len(got), n)
            cache.free(table)

    def evicted_and_back(cache: PrefixCache) -> PrefixCache:
        listed = cache.hottest(100)
        back = PrefixCache(FixedBlockAllocator(64), BS)
        hits = [cache.hits_of(b) for b, _, _ in listed]
        back.adopt([k for _, k, _ in listed], [p for _, _, p in listed], hits)
        return back

    one_off = [list(range(100 * i, 100 * i + 12)) for i in range(8)]  # three blocks each
    first = PrefixCache(FixedBlockAllocator(64), BS)
    serve(first, one_off[:4])
    assert first.keeps_unhit and len(first.hottest(100)) == 12  # no evidence yet: all of them
    idle = evicted_and_back(first)  # a return that serves nothing (warmed ahead) says nothing
    assert idle.keeps_unhit and len(idle.hottest(100)) == 12
    second = evicted_and_back(idle)
    serve(second, one_off[4:])  # nothing it was given is asked for again
    assert not second.keeps_unhit and (second.adopted_unhit, second.adopted_unhit_hit) == (12, 0)
    assert [k for _, k, _ in second.hottest(100)] == keys_of(one_off[7])[:1]  # the probe
    third = evicted_and_back(second)
    serve(third, [[*one_off[7], 5, 6, 7, 8]])  # a conversation's next turn: the probe is hit
    assert third.keeps_unhit and third.adopted_unhit_hit == 1
    # its hit block first, then the rest of the turn, computed again; nothing else was cached
    assert [k for _, k, _ in third.hottest(100)] == keys_of([*one_off[7], 5, 6, 7, 8])
    assert [third.hits_of(b) for b, _, _ in third.hottest(100)] == [1, 0, 0, 0]


def test_kept_prefixes_restored_in_a_new_engine_give_its_uncached_outputs(
    make_engine, chat_prompts, reference, tmp_path
) -> None:
    """An engine's cached prefixes written to a file and read into a fresh engine: the shared system
    prompt is a hit there, with the tokens and logprobs of an engine without a cache; a file of
    another engine (fingerprint) or a budget too small for one block restores or writes nothing."""
    from prism_serve.engine.kept_prefixes import read_header, restore_prefixes, save_prefixes

    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    first = make_engine(block_size=16)
    first.add_request(chat_prompts[0], greedy)
    run_to_completion(first)
    path = tmp_path / "kept.kv"
    size = save_prefixes(first.prefix_cache, first.kv_cache, path, 64 * 2**20, "smollm2|f32")
    header, _ = read_header(path.read_bytes())
    assert size == path.stat().st_size and len(header.keys) == first.prefix_cache.num_evictable_blocks
    assert header.hits == [0] * len(header.keys)  # computed once: none hit yet
    shared = 0
    while chat_prompts[0][shared] == chat_prompts[1][shared]:
        shared += 1
    block_bytes = header.block_bytes
    assert save_prefixes(first.prefix_cache, first.kv_cache, tmp_path / "none.kv", block_bytes, "x") == 0
    assert not (tmp_path / "none.kv").exists()

    second = make_engine(block_size=16)
    assert restore_prefixes(second.prefix_cache, second.kv_cache, path, "another") == 0
    assert restore_prefixes(second.prefix_cache, second.kv_cache, path, "smollm2|f32") == len(header.keys)
    rid = second.add_request(chat_prompts[1], greedy)
    out = run_to_completion(second)[rid]
    assert out.num_cached_tokens == shared // 16 * 16 > 0
    _same(out, reference[1])
    # the restored blocks that were hit go first at the next eviction, with their counts
    again = tmp_path / "again.kv"
    save_prefixes(second.prefix_cache, second.kv_cache, again, 64 * 2**20, "smollm2|f32")
    assert read_header(again.read_bytes())[0].hits[: shared // 16 + 1] == [1] * (shared // 16) + [0]
    # everything restored is reclaimable, and nothing leaked
    assert (
        second.allocator.num_free_blocks + second.prefix_cache.num_evictable_blocks
        == second.allocator.num_total_blocks
    )
