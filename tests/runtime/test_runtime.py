"""The multi-model runtime with real worker processes, the real SmolLM2 weights and real ledgers:
two models on two CPU devices, activation, eviction, aborts and a worker killed mid-request."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import pytest

from prism_serve.config import PolicyConfig
from prism_serve.control import ModelState
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.step_trace import ENV_VAR as STEP_TRACE_ENV
from prism_serve.engine.step_trace import read_step_traces
from prism_serve.errors import (
    EmptyPromptError,
    ModelEvictedError,
    PromptTooLongError,
    WorkerDiedError,
)
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec, UnknownModelError
from prism_serve.runtime.workers import WorkerState

from .conftest import Runtime, wait_until

PARIS = "The capital of France is Paris."
GiB = 2**30


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("steps")


@pytest.fixture(scope="module")
def rt(runtime_factory, step_dir: Path):
    devices = [DeviceSpec("cpu:0", 3 * GiB // 2, (0,), 1), DeviceSpec("cpu:1", 3 * GiB // 2, (1,), 1)]
    # Two names for the same real weights: one host cache file, two independent engines.
    models = [
        ModelSpec("smol", engine=EngineConfig(max_model_len=1024)),
        ModelSpec("smol-b", engine=EngineConfig(max_model_len=1024)),
    ]
    before = os.environ.get(STEP_TRACE_ENV)
    os.environ[STEP_TRACE_ENV] = str(step_dir)  # the workers (spawned now and later) trace their steps
    try:
        yield runtime_factory(devices, models, policy=PolicyConfig(tick_interval_s=0.2))
    finally:
        if before is None:
            del os.environ[STEP_TRACE_ENV]
        else:
            os.environ[STEP_TRACE_ENV] = before


def _model(rt: Runtime, name: str):
    return next(s for s in rt.c.status() if s.model == name)


def _memfd_bytes(pid: int) -> int:
    """Physical bytes of every memfd a process holds (its weight and KV ranges)."""
    total = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if os.readlink(fd).startswith("/memfd:"):
                total += os.stat(fd).st_blocks * 512
        except FileNotFoundError:
            continue
    return total


def _spare_bytes(ledger, pid: int) -> int:
    return sum(e.mapped_bytes for e in ledger.snapshot().entries if e.pid == pid)


def _anon_rss(pid: int) -> int:
    """The process's private anonymous memory (heap, tensors): where a leak grows. Not all of its
    RSS: that also counts the pages of the host cache files an idle worker pre-faults piece by
    piece between polls (shared, and as far along as the machine's load let it get), and the memfd
    pages, which are checked against the ledger on their own."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no RssAnon")


def test_shared_weights_load_once(rt: Runtime) -> None:
    a, b = rt.c.cache.get("smol"), rt.c.cache.get("smol-b")
    assert a.path == b.path and Path(a.path).stat().st_size == a.weight_bytes
    assert rt.c.cache.total_bytes == a.weight_bytes
    # and one tokenizer (built once: a fifth of a second and megabytes each, at thousands of models)
    assert rt.c.models["smol"].tokenizer is rt.c.models["smol-b"].tokenizer


def test_a_request_may_carry_its_own_first_token_deadline(rt: Runtime) -> None:
    """The batch lane's and a scaled tenant's: admission sees the request's own TTFT SLO."""
    from prism_serve.runtime.requests import RequestEntry

    m = rt.c.models.served("smol")
    own = RequestEntry.build("x", m, "hi", SamplingParams(), 100.0, ttft_slo=7.5)
    default = RequestEntry.build("y", m, "hi", SamplingParams(), 100.0)
    assert (own.control.deadline, default.control.deadline) == (107.5, 100.0 + m.spec.ttft_slo)
    rt.generate("smol")
    assert rt.c.is_active("smol")
    with pytest.raises(UnknownModelError):
        rt.c.is_active("nobody")


def test_two_models_stream_at_once_on_two_devices(rt: Runtime) -> None:
    async def both():
        from .conftest import collect

        params = SamplingParams(temperature=0.0, max_tokens=12)
        return await asyncio.gather(
            collect(rt.c, "smol", rt.chat("smol"), params), collect(rt.c, "smol-b", rt.chat("smol-b"), params)
        )

    (text_a, deltas_a), (text_b, deltas_b) = rt.run(both())
    assert text_a == PARIS and text_b == PARIS
    assert len(deltas_a) > 3 and len(deltas_b) > 3  # streamed token by token, not in one piece
    assert deltas_a[-1].finished and deltas_a[-1].finish_reason == "stop"
    sa, sb = _model(rt, "smol"), _model(rt, "smol-b")
    assert sa.state == sb.state == "active"
    assert {sa.device, sb.device} == {"cpu:0", "cpu:1"}  # KVPR placement spreads them


def test_snapshot_carries_measured_engine_seconds_per_request(rt: Runtime) -> None:
    """Compute-aware placement reads ModelSnapshot.busy; live it comes from the engine's own step
    seconds over the requests it served, not from a default profile."""
    for _ in range(4):
        rt.generate("smol-b", max_tokens=6)
    entry = rt.c.models["smol-b"]
    assert entry.num_served >= 4 and entry.step_seconds > 0
    snap = rt.c.snapshot().models["smol-b"]
    measured = snap.profile.busy_s_per_request
    # each step as it takes alone (CPU-timed, at most its wall time): not more than the wall time
    assert 0 < entry.busy_seconds <= entry.step_seconds + 1e-9
    assert measured == pytest.approx(entry.busy_seconds / entry.num_served)
    assert 0 < snap.busy <= 1 and snap.busy == pytest.approx(min(1.0, snap.rate * measured))


def test_the_controller_fits_decode_step_time_against_the_batch_from_the_workers(rt: Runtime) -> None:
    """Requests that overlap on one engine batch their decode steps; the worker sums every decode
    step (batch, CPU seconds) and the controller adds the deltas, so the profile's capacity credits
    the batching: above the step-seconds floor, and a power law the real engine's steps follow."""

    async def overlapping():
        from .conftest import collect

        lengths = (4, 8, 12, 16, 24, 32)  # they finish one by one: batches from 6 down to 1
        return await asyncio.gather(
            *(
                collect(rt.c, "smol-b", [1000 + i, 1001, 1002], SamplingParams(max_tokens=n, ignore_eos=True))
                for i, n in enumerate(lengths)
            )
        )

    before = rt.c.models["smol-b"].decode
    rt.run(overlapping())
    entry = rt.c.models["smol-b"]
    added = entry.decode - before
    assert added.steps >= 16 and added.batch > added.steps  # batched decode steps were counted
    fit = entry.decode.fit()
    assert fit is not None and fit[0] > 0 and 0 <= fit[1] <= 1
    snap = rt.c.snapshot().models["smol-b"]
    assert snap.profile.max_rate > entry.num_served / entry.step_seconds


def test_workers_trace_every_step_with_its_shape(rt: Runtime, step_dir: Path) -> None:
    """PRISM_STEP_TRACE: each step of a request as the simulator counts it (the prompt in one
    chunk, then one decode per token over a growing context), with its wall and CPU seconds."""
    start = time.time()
    prompt = rt.c.models.tokenizer("smol-b").encode(rt.chat("smol-b"))
    rt.generate("smol-b", prompt, max_tokens=6, ignore_eos=True)
    steps = [r for r in read_step_traces([step_dir]) if r.model == "smol-b" and r.t >= start - 0.01]
    p = len(prompt)
    # the prompt in one chunk after what the prefix cache held of it (this chat was served before:
    # whole 16-token blocks of it, never its last token)
    assert len(steps) == 6
    [(new, cached, sampled)] = steps[0].batch
    assert new + cached == p and cached % 16 == 0 and new >= 1 and sampled
    assert [r.batch for r in steps[1:]] == [[(1, p + k, True)] for k in range(5)]
    for r in steps:
        assert r.dt > 0 and 0 < r.cpu <= r.dt + 0.005


def test_activation_phases_are_reported(rt: Runtime) -> None:
    rt.run(rt.c.unload("smol"))
    assert _model(rt, "smol").state == "evicted"
    phases = rt.run(rt.c.load("smol", "cpu:0"))
    cached = rt.c.cache.get("smol")
    assert phases.copy_bytes == sum(t.nbytes for t in cached.tensors)
    assert phases.map_s > 0 and phases.copy_s > 0 and phases.ready_s > 0 and phases.take_s >= 0
    assert _model(rt, "smol").last_activation == phases
    assert rt.c.snapshot().models["smol"].placed_at is not None  # prism's migration cooldown sees it
    assert rt.generate("smol", max_tokens=12)[0] == PARIS  # the weights copied from the cache are right


def test_50_activate_serve_evict_cycles_leak_nothing(rt: Runtime) -> None:
    c = rt.c
    ledger = c.nodes.ledger("cpu:0")
    rt.run(c.unload("smol"))
    page = c.pool.page_size
    weight_pages = -(-c.cache.get("smol").weight_bytes // page) * page
    samples = {}
    for cycle in range(50):
        phases = rt.run(c.load("smol", "cpu:0"))
        text, _ = rt.generate("smol", max_tokens=4)
        assert text  # served
        assert rt.run(c.unload("smol")) is True
        snap = ledger.snapshot()
        # weights and KV both given back: what stays is spare weight pages (memory/spare.py),
        # never more than one model's worth per worker, each byte of them in the ledger
        assert all(e.spare for e in snap.entries) and snap.used_bytes == snap.spare_bytes
        assert snap.spare_bytes <= len(c.pool.on_device("cpu:0")) * weight_pages
        if cycle in (9, 49):
            workers = [w for w in c.pool.on_device("cpu:0") if w.state is WorkerState.IDLE]
            for w in workers:
                # no physical page left behind beyond the spare pages the ledger counts (read once
                # the worker has settled: an idle worker may still be giving pages back)
                wait_until(lambda w=w: _memfd_bytes(w.pid) == _spare_bytes(ledger, w.pid), 10.0)
            samples[cycle] = {w.pid: _anon_rss(w.pid) for w in workers}
        if cycle > 0:  # the worker that served it kept the pages: nothing created again
            assert phases.created_pages == 0 and phases.reused_pages == weight_pages // page
    assert samples[9].keys() == samples[49].keys()  # the pool neither grew nor lost workers
    for pid, anon in samples[49].items():
        grew = anon - samples[9][pid]
        assert grew < 64 * 2**20, f"worker {pid}'s private memory grew {grew} B"


def test_forced_unload_ends_requests_in_flight_with_a_clear_error(rt: Runtime) -> None:
    c = rt.c

    async def scenario():
        stream = c.generate("smol", rt.chat("smol"), SamplingParams(max_tokens=400, ignore_eos=True))
        first = await anext(stream)
        assert await c.unload("smol", force=False) is False  # busy: refused, keeps serving
        assert await c.unload("smol", force=True) is True
        with pytest.raises(ModelEvictedError, match="unloaded"):
            async for _ in stream:
                pass
        return first

    assert rt.run(scenario()).text
    assert _model(rt, "smol").state == "evicted" and _model(rt, "smol").num_running == 0
    # an unloaded model stays unloaded: the forecast does not prewarm it at the next ticks
    assert "smol" in c.loop.held
    time.sleep(1.0)
    assert _model(rt, "smol").state == "evicted"
    assert rt.generate("smol", max_tokens=12)[0] == PARIS  # a new request activates it again


def test_a_busy_model_is_never_shown_evicted_nor_held_by_two_engines(rt: Runtime) -> None:
    """A graceful eviction of a model with requests in flight is refused on the spot: the model stays
    ACTIVE throughout, so no placement can start a second engine for it meanwhile. If the engine
    refuses anyway (the controller's view lags it) after the model was placed again, the new
    placement stands and the old engine is evicted by force."""
    c = rt.c
    rt.generate("smol", max_tokens=2)

    async def scenario():
        stream = c.generate("smol", rt.chat("smol"), SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        m = c.models["smol"]
        handle, device = m.worker, m.device
        done = c.activator.evict(m, force=False)
        assert done.done() and done.result() is False and m.state is ModelState.ACTIVE

        in_flight = set(handle.in_flight)
        handle.in_flight.clear()  # the controller's view lags the engine's, as with an abort on its way
        done = c.activator.evict(m, force=False)
        handle.in_flight |= in_flight
        assert m.state is ModelState.EVICTED
        other = next(d for d in c.devices if d != device)
        c.activator.activate(m, (other,))  # placed again while the refusal is on its way
        assert await done is True  # the old engine went, by force
        with pytest.raises(ModelEvictedError):
            async for _ in stream:
                pass
        await m.activation
        assert m.state is ModelState.ACTIVE and m.device == other and m.worker is not handle
        # the old engine holds nothing any more (its worker may keep spare pages, no model's)
        held = {e.pid for e in c.nodes.ledger(device).snapshot().entries if not e.spare}
        assert held.isdisjoint({handle.pid})

    rt.run(scenario())
    assert rt.generate("smol", max_tokens=12)[0] == PARIS


def test_client_abort_frees_its_kv(rt: Runtime) -> None:
    c = rt.c
    rt.generate("smol", max_tokens=2)

    async def abort_after_two():
        n = 0
        async for _ in c.generate("smol", rt.chat("smol"), SamplingParams(max_tokens=400, ignore_eos=True)):
            n += 1
            if n == 2:
                break  # leaving the loop aborts the request

    rt.run(abort_after_two())
    worker = c.models["smol"].worker
    wait_until(lambda: worker.stats.used_kv_bytes == 0 and not worker.in_flight)
    assert _model(rt, "smol").num_running == 0


def test_bad_requests_get_named_errors_and_break_nothing(rt: Runtime) -> None:
    with pytest.raises(UnknownModelError):
        rt.generate("nope")
    with pytest.raises(EmptyPromptError):
        rt.generate("smol", [])
    with pytest.raises(PromptTooLongError):
        rt.generate("smol", [1] * 1024)
    assert rt.generate("smol", max_tokens=12)[0] == PARIS


def test_sigkill_of_a_worker_mid_request(rt: Runtime) -> None:
    c = rt.c
    rt.generate("smol", max_tokens=2)
    rt.generate("smol-b", max_tokens=2)
    victim = c.models["smol"].worker
    device = victim.device.name
    other_before = c.models["smol-b"].worker

    async def scenario():
        long = c.generate("smol", rt.chat("smol"), SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(long)
        other = asyncio.ensure_future(
            _collect(c.generate("smol-b", rt.chat("smol-b"), SamplingParams(temperature=0.0, max_tokens=12)))
        )
        os.kill(victim.pid, signal.SIGKILL)
        with pytest.raises(WorkerDiedError, match="died"):
            async for _ in long:
                pass
        return await other

    assert rt.run(scenario()) == PARIS  # the other model kept serving
    # the kill took one worker: smol-b's is alive, serving it still or back in the pool (the tests
    # before may leave smol-b a replica, smol-b#1, and prism may drop one of the two copies now)
    assert other_before is not victim and other_before.state is not WorkerState.DEAD
    assert other_before.proc.poll() is None
    # smol lost its engine: evicted, unless a tick has prewarmed it again since (its forecast is busy)
    smol = c.models["smol"]
    assert smol.worker is not victim
    snap = c.nodes.ledger(device).snapshot()
    # the dead worker's pages are reclaimed: the device holds only the engines of resident models
    owners = {m.worker.pid for m in c.models.values() if m.worker is not None and m.device == device}
    assert {e.pid for e in snap.entries if not e.spare} <= owners and victim.pid not in owners
    assert victim.pid not in {e.pid for e in snap.entries}  # its spare pages too
    wait_until(lambda: len([w for w in c.pool.on_device(device) if w.state is WorkerState.IDLE]) >= 1)
    assert rt.generate("smol", max_tokens=12)[0] == PARIS  # reactivated on a live worker


async def _collect(stream) -> str:
    return "".join([d.text async for d in stream])


def test_unload_without_force_is_refused_while_any_replica_is_busy(runtime_factory) -> None:
    """``unload`` covers every replica: without ``force`` it reports a refusal when one of them has
    requests in flight, even though the idle one goes. (``replica_low`` 0: prism never drops the
    idle replica itself, so it is there when ``unload`` runs.)"""
    devices = [DeviceSpec("cpu:0", 3 * GiB // 2, (0,), 1), DeviceSpec("cpu:1", 3 * GiB // 2, (1,), 1)]
    rt = runtime_factory(
        devices,
        [ModelSpec("smol", engine=EngineConfig(max_model_len=1024))],
        policy=PolicyConfig(tick_interval_s=0.2, knobs={"replica_low": 0.0}),
    )
    c = rt.c

    async def scenario():
        stream = c.generate("smol", rt.chat("smol"), SamplingParams(max_tokens=400, ignore_eos=True))
        await anext(stream)
        base, slot = c.models["smol"], c.models["smol#1"]
        if slot.state is ModelState.EVICTED:
            c.activator.activate(slot, (next(d for d in c.devices if d != base.device),))
        await slot.activation
        assert slot.state is ModelState.ACTIVE
        assert await c.unload("smol", force=False) is False
        assert slot.state is ModelState.EVICTED and base.state is ModelState.ACTIVE
        assert await c.unload("smol", force=True) is True
        with pytest.raises(ModelEvictedError):
            async for _ in stream:
                pass

    rt.run(scenario())
    assert _model(rt, "smol").state == "evicted" and _model(rt, "smol").replicas == ()
