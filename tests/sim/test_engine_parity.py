"""The simulator's engine (sim/engine.py) against the live engine (engine/llm_engine.py).

The same arrivals (prompt and output lengths, each arriving before a given step) go to a real
``LLMEngine`` (its Scheduler on a FixedBlockAllocator, its postprocess and stop checks; the model
runner is a fake that samples exactly where the real one samples, on a tiny synthetic model) and
to a ``SimEngine`` on a ``SimDevice`` of exactly as many KV blocks (one block per page). Each step
is compared whole: the requests scheduled and the tokens each is fed, the ones that sample, the ones
preempted, the ones finished (in order), the running and waiting queues after it, and the blocks
every running request holds. That is with ``max_run_steps=1``; with the default, decode runs must
give the same steps (all but the blocks, which a run grants up front) and so the same first-token
and finish steps. A model whose sliding-window layers sit beside full-context ones (KVGroups) is
compared the same way: its blocks are one group's, and its windowed groups free what their window
has passed, step by step on both sides.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections import deque
from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.engine.kv_cache import KVGroups
from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.models.llama import LlamaForCausalLM
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.scheduler import SchedulerOutput
from prism_serve.engine.weights import random_weights
from prism_serve.sim import HARDWARE, RooflineCostModel, SimConfig
from prism_serve.sim.engine import SimEngine, SimRequest
from prism_serve.sim.memory import SimDevice
from prism_serve.sim.models import ModelShape, ServedModel

from .helpers import served

TOKEN = 7  # what the fake model samples; the synthetic byte tokenizer has no EOS
MAX_STEPS = 20_000  # a schedule that runs longer than this is stuck
TINY = ArchConfig("llama", 256, 16, 32, 1, 2, 1, 8, 8192)  # SYNTHETIC: only the engine's loop matters


def windowed(window: int) -> ArchConfig:
    """TINY with five layers, two of them global and three windowed (SYNTHETIC): KV groups of two
    layers, one full-context and two windowed, the last padded, as Gemma's are split."""
    return replace(TINY, num_layers=5, sliding_window=window, global_layers=(1, 3))


@dataclass(frozen=True, slots=True)
class Arrival:
    step: int  # added before this step is scheduled
    prompt: int
    output: int


@dataclass(frozen=True, slots=True)
class Limits:
    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


@dataclass(frozen=True, slots=True)
class Step:
    """One engine step as either side reports it (request ids are the arrival indices)."""

    index: int
    scheduled: tuple[tuple[str, int], ...]  # (request, tokens fed), in schedule order
    sampled: tuple[str, ...]  # requests that produced a token
    preempted: tuple[str, ...]  # in preemption order
    finished: tuple[str, ...]
    running: tuple[str, ...]  # after the step
    waiting: tuple[str, ...]
    blocks: tuple[int, ...] | None  # blocks held by each running request after the step


# -- the live side ---------------------------------------------------------------------------------


class Tiny:
    """A synthetic model built once; engines of any KV size share it."""

    def __init__(self, config: ArchConfig = TINY) -> None:
        self.config = config
        self.weights = random_weights(config)
        self.model = LlamaForCausalLM(
            config, self.weights.tensors, torch.float32, config.max_position_embeddings
        )
        self.groups = KVGroups.of(config, config.max_position_embeddings)

    def __repr__(self) -> str:
        return f"Tiny(window={self.config.sliding_window})"  # hypothesis prints a failing example's


@pytest.fixture(scope="module")
def tiny() -> Tiny:
    return Tiny()


@functools.cache
def tiny_windowed(window: int) -> Tiny:
    return Tiny(windowed(window))


class FakeRunner:
    """Stands in for ModelRunner.execute: a token for every chunk that reaches the last known
    token (``ScheduledSeq.samples``, where the real runner samples), None for the others."""

    def execute(self, sched: SchedulerOutput) -> list[int | None]:
        return [TOKEN if s.samples else None for s in sched.scheduled]


def live_engine(tiny: Tiny, lim: Limits, *, real_model: bool = False) -> LLMEngine:
    config = EngineConfig(
        block_size=lim.block_size,
        max_num_seqs=lim.max_num_seqs,
        max_num_batched_tokens=lim.max_num_batched_tokens,
        num_kv_blocks=lim.num_blocks,
        max_model_len=tiny.config.max_position_embeddings,  # so max_seq_len is the whole KV cache
        dtype="float32",  # the tiny model's (auto is bfloat16 on a CPU with native bf16 matmuls)
        # the prompts here are all one token, and SimEngine below gets no block keys: compared
        # without prefix caching (tests/sim/test_prefix_cache.py covers the simulated cache)
        prefix_caching=False,
    )
    engine = LLMEngine(config, weights=tiny.weights, model=tiny.model)
    if not real_model:
        engine.runner = FakeRunner()  # type: ignore[assignment]
    return engine


def run_live(tiny: Tiny, arrivals: list[Arrival], lim: Limits, *, real_model: bool = False) -> list[Step]:
    engine = live_engine(tiny, lim, real_model=real_model)
    sched = engine.scheduler
    outputs: list[SchedulerOutput] = []  # what each engine.step() scheduled
    schedule = sched.schedule

    def recorded() -> SchedulerOutput:
        outputs.append(schedule())
        return outputs[-1]

    sched.schedule = recorded  # type: ignore[method-assign]
    pending = deque(sorted(enumerate(arrivals), key=lambda x: x[1].step))
    params = [SamplingParams(max_tokens=a.output, ignore_eos=True, temperature=0) for a in arrivals]
    steps: list[Step] = []
    t = 0
    while pending or engine.has_unfinished_requests():
        if len(steps) > MAX_STEPS:
            raise AssertionError("the live engine did not finish")
        while pending and pending[0][1].step <= t:
            i, a = pending.popleft()
            engine.add_request([1] * a.prompt, params[i], req_id=str(i))
        results = engine.step()
        out = outputs[-1]
        if not out.scheduled:
            if not pending:
                break  # stalled with requests left: the comparison shows it
            t = max(t, pending[0][1].step)
            continue
        steps.append(
            Step(
                t,
                tuple((s.seq.req_id, s.num_new_tokens) for s in out.scheduled),
                tuple(r.req_id for r in results),  # one output per sampled token
                tuple(s.req_id for s in out.preempted),
                tuple(r.req_id for r in results if r.finished),
                tuple(s.req_id for s in sched.running),
                tuple(s.req_id for s in sched.waiting),
                tuple(
                    sum(b >= 0 for t in (s.block_table, *s.group_tables) for b in t) for s in sched.running
                ),
            )
        )
        t += 1
    return steps


# -- the simulated side ----------------------------------------------------------------------------


def sim_engine(lim: Limits, max_run_steps: int, config: ArchConfig = TINY) -> SimEngine:
    # a windowed model's own shape: its groups' blocks are bytes of its layers
    m = served("m", "llama-3.2-1b") if config is TINY else ServedModel("m", ModelShape("w", config, 4))
    groups = KVGroups.of(config, config.max_position_embeddings)
    block_bytes = m.spec.kv_bytes_per_token * groups.layers_per_group // config.num_layers * lim.block_size
    # one block per page, as many pages as the live allocator has blocks
    dev = SimDevice("d", lim.num_blocks * block_bytes, block_bytes)
    e = SimEngine(
        m,
        [dev],
        RooflineCostModel(HARDWARE["h100"]),
        block_size=lim.block_size,
        max_num_seqs=lim.max_num_seqs,
        max_num_batched_tokens=lim.max_num_batched_tokens,
        max_run_steps=max_run_steps,
        kv_groups=groups,
    )
    assert e.block_bytes == block_bytes
    return e


def run_sim(
    arrivals: list[Arrival], lim: Limits, max_run_steps: int = 1, config: ArchConfig = TINY
) -> list[Step]:
    """SimEngine driven through start_step / cut / finish_step. A decode run of k steps is reported
    as k steps (blocks are then not compared: a run holds its blocks for all k steps up front)."""
    e = sim_engine(lim, max_run_steps, config)
    pending = deque(sorted(enumerate(arrivals), key=lambda x: x[1].step))
    steps: list[Step] = []
    t = 0
    now = 0.0
    while pending or e.num_requests:
        if len(steps) > MAX_STEPS:
            raise AssertionError("the simulated engine did not finish")
        while pending and pending[0][1].step <= t:
            i, a = pending.popleft()
            e.add(SimRequest(str(i), "m", float(t), a.prompt, a.output, 1.0, 1.0, control=None))
        num_preemptions = e.num_preemptions
        end = e.start_step(now)
        if end is None:
            if not pending:
                break
            t = max(t, pending[0][1].step)
            continue
        k = e._run_k or 1
        if k > 1 and pending and pending[0][1].step < t + k:
            # the next arrival comes before the run's last step: cut after step pending.step - 1,
            # as the simulator cuts a run at the first step boundary after a dispatch
            j = pending[0][1].step - t
            before = float(e._cum[j - 2]) if j > 1 else 0.0
            end = e.cut(e.start + (before + float(e._cum[j - 1])) / 2)  # inside step j - 1
            assert end is not None and e._run_k == j
            k = j
        scheduled = tuple((s.req.req_id, n) for s, n in e._scheduled)
        sampled = tuple(s.req.req_id for s, n in e._scheduled if s.num_computed + n == s.num_tokens)
        preempted = tuple(s.req.req_id for s in list(e.waiting)[: e.num_preemptions - num_preemptions])
        preempted = preempted[::-1]  # appendleft put the newest victim first
        queues = (tuple(s.req.req_id for s in e.running), tuple(s.req.req_id for s in e.waiting))
        finished, _ = e.finish_step(end)
        now = end
        for j in range(k):  # inside a run nobody arrives and nobody finishes
            last = j == k - 1
            if last:
                queues = (tuple(s.req.req_id for s in e.running), tuple(s.req.req_id for s in e.waiting))
            blocks = tuple(e.held_blocks(s) for s in e.running) if last and max_run_steps == 1 else None
            done = tuple(r.req_id for r in finished) if last else ()
            steps.append(Step(t + j, scheduled, sampled, preempted if j == 0 else (), done, *queues, blocks))
        t += k
    return steps


# -- comparing -------------------------------------------------------------------------------------


def assert_same(live: list[Step], sim: list[Step], *, blocks: bool = True, case: str = "") -> None:
    for a, b in zip(live, sim, strict=False):
        if not blocks:
            a = replace(a, blocks=None)
        assert a == b, f"{case}\nfirst divergence at step {a.index}:\n live {a}\n sim  {b}"
    assert len(live) == len(sim), f"{case}\nlive ran {len(live)} steps, the simulator {len(sim)}"


def first_token_and_finish(steps: list[Step]) -> tuple[dict[str, int], dict[str, int]]:
    first: dict[str, int] = {}
    done: dict[str, int] = {}
    for s in steps:
        for r in s.sampled:
            first.setdefault(r, s.index)
        for r in s.finished:
            done[r] = s.index
    return first, done


def check(tiny: Tiny, arrivals: list[Arrival], lim: Limits) -> list[Step]:
    live = run_live(tiny, arrivals, lim)
    assert_same(live, run_sim(arrivals, lim, config=tiny.config), case=f"{arrivals} {lim} {tiny}")
    assert sorted(r for s in live for r in s.finished) == sorted(str(i) for i in range(len(arrivals)))
    return live


def preemptions(steps: list[Step]) -> int:
    return sum(len(s.preempted) for s in steps)


# -- hand-written cases ----------------------------------------------------------------------------


def test_scheduler_imports_without_torch():
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import prism_serve.engine.scheduler, prism_serve.engine.kv_cache, prism_serve.sim.engine"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_chunked_prefills_longer_than_the_token_budget(tiny):
    lim = Limits(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    steps = check(tiny, [Arrival(0, 50, 3), Arrival(0, 37, 5), Arrival(2, 16, 2), Arrival(9, 1, 4)], lim)
    assert steps[0].scheduled == (("0", 16),)
    assert [n for s in steps for r, n in s.scheduled if r == "0"][:4] == [16, 16, 16, 2]
    assert preemptions(steps) == 0


def test_max_num_seqs_holds_requests_back(tiny):
    lim = Limits(num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64)
    steps = check(tiny, [Arrival(0, 5, 6), Arrival(0, 5, 2), Arrival(0, 5, 3), Arrival(1, 5, 1)], lim)
    assert max(len(s.running) for s in steps) == 2
    assert steps[0].waiting == ("2",)


def test_kv_blocks_running_out_preempt_the_newest(tiny):
    # 6 blocks of 4 tokens: three 7-token prompts fit (2 blocks each) but cannot all grow
    lim = Limits(num_blocks=6, block_size=4, max_num_seqs=8, max_num_batched_tokens=64)
    steps = check(tiny, [Arrival(0, 7, 9), Arrival(0, 7, 9), Arrival(0, 7, 9), Arrival(3, 3, 2)], lim)
    first = next(s for s in steps if s.preempted)
    assert first.preempted == ("2",) and first.waiting == ("2",)
    assert first.scheduled == (("0", 1), ("1", 1))
    # recomputed later from its prompt and the 2 tokens it had produced
    assert next(n for s in steps[first.index + 1 :] for r, n in s.scheduled if r == "2") == 9
    assert preemptions(steps) == 2


def test_the_oldest_request_keeps_running_while_newer_ones_are_preempted(tiny):
    lim = Limits(num_blocks=4, block_size=4, max_num_seqs=8, max_num_batched_tokens=8)
    steps = check(tiny, [Arrival(0, 6, 10), Arrival(0, 4, 12), Arrival(1, 3, 3), Arrival(1, 2, 5)], lim)
    assert [r for s in steps for r in s.preempted] == ["2", "1", "3", "3"]
    assert [r for s in steps for r in s.finished] == ["0", "2", "1", "3"]


def test_a_request_that_cannot_grow_preempts_itself(tiny):
    # 3 blocks of 2 tokens: at step 1 request 0 takes the last block, and request 1, the newest,
    # cannot grow and is its own victim; it waits until request 0 has finished
    lim = Limits(num_blocks=3, block_size=2, max_num_seqs=8, max_num_batched_tokens=8)
    steps = check(tiny, [Arrival(0, 2, 3), Arrival(0, 2, 3)], lim)
    assert steps[1].scheduled == (("0", 1),) and steps[1].preempted == ("1",)
    assert steps[2].finished == ("0",) and steps[3].scheduled == (("1", 3),)


def test_requests_finish_at_different_steps_and_one_at_the_kv_limit(tiny):
    lim = Limits(num_blocks=8, block_size=2, max_num_seqs=3, max_num_batched_tokens=6)
    # request 0 reaches max_seq_len (16) exactly as it reaches max_tokens
    steps = check(tiny, [Arrival(0, 10, 6), Arrival(0, 3, 1), Arrival(0, 2, 4), Arrival(5, 4, 2)], lim)
    order = [r for s in steps for r in s.finished]
    assert len({s.index for s in steps if s.finished}) >= 3
    assert order.index("1") < order.index("0")


def test_the_fake_model_samples_where_the_real_one_does(tiny):
    """The fake runner stands for the real one: the tiny synthetic model, run for real (chunked
    prefills, decodes, recompute after preemption), gives the same schedule step by step."""
    lim = Limits(num_blocks=7, block_size=4, max_num_seqs=3, max_num_batched_tokens=8)
    arrivals = [Arrival(0, 11, 9), Arrival(0, 7, 9), Arrival(1, 9, 4), Arrival(4, 3, 2)]
    steps = run_live(tiny, arrivals, lim)
    fed = [(arrivals[int(r)].prompt, n) for s in steps for r, n in s.scheduled]
    assert preemptions(steps) > 0 and any(1 < n < prompt for prompt, n in fed)  # chunks too
    assert run_live(tiny, arrivals, lim, real_model=True) == steps


def test_the_check_fails_when_the_simulator_admits_after_a_preemption(tiny, monkeypatch):
    """The comparison has teeth: a SimEngine that also admits waiting requests in a step that
    preempted diverges. At step 3 the older request needs a third block and preempts the newer
    one, whose recompute chunk would fit the freed block at once; the live engine waits a step."""
    arrivals = [Arrival(0, 1, 4), Arrival(1, 1, 3)]
    lim = Limits(num_blocks=3, block_size=2, max_num_seqs=2, max_num_batched_tokens=3)
    steps = check(tiny, arrivals, lim)
    assert steps[3].preempted == ("1",) and steps[3].scheduled == (("0", 1),)
    schedule = SimEngine._schedule

    def admitting_after_preemption(self: SimEngine) -> list:
        num_preemptions = self.num_preemptions
        scheduled = schedule(self)
        budget = self.max_num_batched_tokens - sum(n for _, n in scheduled)
        while self.num_preemptions > num_preemptions and self.waiting and budget > 0:
            seq = self.waiting[0]
            n = min(seq.num_tokens - seq.num_computed, budget)
            if len(self.running) >= self.max_num_seqs or not self._grow(seq, seq.num_computed + n):
                break
            self.running.append(self.waiting.popleft())
            scheduled.append((seq, n))
            budget -= n
        return scheduled

    monkeypatch.setattr(SimEngine, "_schedule", admitting_after_preemption)
    with pytest.raises(AssertionError, match="first divergence at step 3"):
        check(tiny, arrivals, lim)


# -- random arrivals -------------------------------------------------------------------------------


@st.composite
def workloads(draw, groups: KVGroups | None = None) -> tuple[list[Arrival], Limits]:
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    arrivals = draw(
        st.lists(
            st.builds(Arrival, st.integers(0, 40), st.integers(1, 70), st.integers(1, 40)),
            min_size=1,
            max_size=12,
        )
    )
    chunk = draw(st.sampled_from([1, 3, 8, 16, 32, 64, 256]))
    # the longest request must fit the whole cache (the live engine refuses longer prompts and
    # ends a request at max_seq_len); half the time little more than that, so preemption is common
    groups = groups or KVGroups.of(TINY)
    need = max(groups.max_blocks(a.prompt + a.output, block_size, chunk) for a in arrivals)
    lim = Limits(
        num_blocks=need + draw(st.integers(0, 4) | st.integers(0, 3 * need)),
        block_size=block_size,
        max_num_seqs=draw(st.integers(1, 8)),
        max_num_batched_tokens=chunk,
    )
    return arrivals, lim


@st.composite
def windowed_workloads(draw) -> tuple[Tiny, list[Arrival], Limits]:
    tiny = tiny_windowed(draw(st.sampled_from([3, 8, 16])))
    return (tiny, *draw(workloads(tiny.groups)))


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_random_arrivals_schedule_identically_step_by_step(tiny, case):
    arrivals, lim = case
    check(tiny, arrivals, lim)


@settings(max_examples=150, deadline=None)
@given(workloads())
def test_decode_runs_keep_every_request_on_the_same_steps(case):
    """With the default max_run_steps, runs of decode steps leave every step's schedule, every
    first token and every finish on the step it has one step at a time."""
    arrivals, lim = case
    one = run_sim(arrivals, lim, max_run_steps=1)
    runs = run_sim(arrivals, lim, max_run_steps=SimConfig(num_devices=1).max_run_steps)
    assert_same(one, runs, blocks=False, case=f"{arrivals} {lim}")
    assert first_token_and_finish(one) == first_token_and_finish(runs)


@settings(max_examples=150, deadline=None)
@given(windowed_workloads())
def test_windowed_layers_free_the_same_blocks_step_by_step(case):
    """A model with sliding-window layers beside global ones: the same schedule and, every step,
    the same blocks held by each request, its windowed groups' passed blocks freed on both sides."""
    tiny, arrivals, lim = case
    check(tiny, arrivals, lim)


def test_a_long_request_holds_its_window_not_its_length_in_windowed_groups():
    """Window 8, blocks of 4, one request of 60 + 30 tokens in chunks of 16: the full-context group
    holds all 23 blocks at the end, each of the two windowed groups the few its window reads."""
    tiny = tiny_windowed(8)
    lim = Limits(num_blocks=64, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    steps = check(tiny, [Arrival(0, 60, 30)], lim)
    assert tiny.groups.num_groups == 3 and sum(tiny.groups.windowed) == 2
    last = steps[-2]  # the step before the one that finishes it
    assert last.running == ("0",) and last.scheduled == (("0", 1),)
    # it computes position 87 (4 prefill steps, then one token a step): the full-context group
    # holds 88 / 4 = 22 blocks, a windowed one those from token 87 - 7 = 80 on, blocks 20 and 21
    assert len(steps) == 4 + 29 and last.blocks == (22 + 2 * 2,)
    e = sim_engine(lim, 1, tiny.config)
    assert e.kv_window == (8 - 1 + 16 + 2 * 4, 2 * e.kv_bytes_per_token)
    assert e.kv_bytes(90) == 90 * e.kv_bytes_per_token + 31 * 2 * e.kv_bytes_per_token
