"""Fault injection on the path from accepting a request to handing it to a worker: at each step a
failure is injected, the request must end with a named error, and everything it registered
(request table, running counts, worker in-flight sets, device queues, backlog, KV) must be released,
with the model serving the next request normally."""

from __future__ import annotations

import pytest

from prism_serve.config import PolicyConfig
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.errors import InternalError, InvalidSamplingParamsError, PrismError
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ActivationError, ModelSpec
from prism_serve.runtime.state import ModelEntry

from .conftest import Runtime, collect

GiB = 2**30


class Injected(RuntimeError):
    """The fault this test injects (a bug or an OS error anywhere on the path)."""


@pytest.fixture(scope="module")
def rt(runtime_factory) -> Runtime:
    devices = [DeviceSpec("cpu:0", 2 * GiB, (0,), 1)]
    tiny = ModelSpec("tiny", source="random:smollm2-135m", engine=EngineConfig(max_model_len=256))
    return runtime_factory(devices, [tiny], policy=PolicyConfig(tick_interval_s=0.2))


def released(rt: Runtime) -> None:
    c = rt.c
    assert not len(c.requests)
    assert not c.loop.requests and not c.loop.where and not c.loop.backlog
    assert all(len(q) == 0 for q in c.loop.queues.values()) and not +c.loop.num_queued
    assert all(m.num_running == 0 for m in c.models.values())
    assert all(not w.in_flight for w in c.pool.workers.values())


def still_serves(rt: Runtime) -> None:
    _, deltas = rt.run(
        collect(rt.c, "tiny", [1, 2, 3], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    )
    assert deltas[-1].finished and deltas[-1].num_output_tokens == 3
    released(rt)
    stats = rt.c.models["tiny"].worker.stats
    assert stats is not None and stats.used_kv_bytes == 0  # the engine freed every block


def fail_once(obj, name: str, monkeypatch) -> None:
    original = getattr(obj, name)

    def boom(*args, **kwargs):
        monkeypatch.setattr(obj, name, original)
        raise Injected(f"injected into {name}")

    monkeypatch.setattr(obj, name, boom)


def run_one(rt: Runtime, params: SamplingParams | None = None) -> BaseException:
    params = params or SamplingParams(max_tokens=3, temperature=0)
    with pytest.raises((PrismError, Injected)) as info:
        rt.run(collect(rt.c, "tiny", [1, 2, 3], params))
    return info.value


@pytest.mark.parametrize("evicted", [False, True], ids=["active", "evicted"])
@pytest.mark.parametrize("step", ["on_request", "admit"])
def test_a_policy_failure_releases_the_request(rt, monkeypatch, step, evicted):
    if evicted:
        rt.run(rt.c.unload("tiny"))
    else:
        still_serves(rt)
    fail_once(rt.c.policy, step, monkeypatch)
    assert isinstance(run_one(rt), Injected)  # the caller sees the failure (the server: a 500)
    released(rt)
    still_serves(rt)


def test_a_failed_send_releases_the_request(rt, monkeypatch):
    still_serves(rt)
    fail_once(rt.c.pool, "send", monkeypatch)
    assert isinstance(run_one(rt), InternalError)
    released(rt)
    still_serves(rt)


def test_a_value_the_wire_cannot_carry_is_refused_before_anything_is_registered(rt):
    params = SamplingParams(max_tokens=3)
    params.seed = 2**70  # set after validation: only the encoder can notice
    assert isinstance(run_one(rt, params), InvalidSamplingParamsError)
    released(rt)
    still_serves(rt)


def test_a_failed_activation_fails_its_waiting_requests_and_the_next_one_activates(rt, monkeypatch):
    rt.run(rt.c.unload("tiny"))
    fail_once(ModelEntry, "activate_message", monkeypatch)
    assert isinstance(run_one(rt), ActivationError)
    released(rt)
    still_serves(rt)


def test_a_failure_while_placing_after_an_activation_does_not_fail_it(rt, monkeypatch):
    rt.run(rt.c.unload("tiny"))
    fail_once(rt.c.policy, "place", monkeypatch)
    still_serves(rt)  # activation went through; the request was admitted (by then or by a tick)


def test_a_shield_left_behind_retrieves_its_workers_death():
    """take() waits for the first of several starting workers; the shields of the others are left
    behind, and a worker dying later (at shutdown) must not log "Future exception was never
    retrieved" (asyncio reports an unretrieved exception when the future is collected)."""
    import asyncio
    import gc

    from prism_serve.errors import WorkerDiedError
    from prism_serve.runtime.workers import shielded

    reported: list[dict] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda _loop, context: reported.append(context))
        first, other = loop.create_future(), loop.create_future()
        waiting = asyncio.ensure_future(asyncio.wait([shielded(first), shielded(other)],
                                                     return_when=asyncio.FIRST_COMPLETED))  # fmt: skip
        await asyncio.sleep(0)
        first.set_result(None)
        await waiting
        other.set_exception(WorkerDiedError("worker cpu:0/w1 died (exit status -15)"))
        other.exception()  # the manager retrieves its own future (workers.py _died)
        await asyncio.sleep(0)
        del waiting, first, other
        gc.collect()
        await asyncio.sleep(0)

    asyncio.run(main())
    assert not [c for c in reported if "never retrieved" in c.get("message", "")], reported
