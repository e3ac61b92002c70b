"""What the live controller takes as a model's compute demand: each engine step as it would take
alone (the worker's CPU-timed busy seconds), not its wall time, which on a shared core also holds
the slices its neighbours ran in (the policies add that contention for a placement themselves)."""

from __future__ import annotations

from prism_serve.control.profiles import MIN_SERVED_FOR_PROFILE
from prism_serve.engine.config import EngineConfig
from prism_serve.runtime import messages as msg
from prism_serve.runtime.models import ModelSpec
from prism_serve.runtime.state import ModelEntry


def _stats(step_s: float, busy_s: float) -> msg.EngineStats:
    return msg.EngineStats(
        num_running=0, num_waiting=0, used_kv_bytes=0, mapped_kv_bytes=0, weight_bytes=0,
        step_seconds=step_s, cpu_seconds=busy_s, busy_seconds=busy_s,
    )  # fmt: skip


def test_the_profile_counts_steps_as_they_take_alone_over_every_activation():
    entry = ModelEntry(
        ModelSpec("m", engine=EngineConfig(max_model_len=1024)),
        cached=None,
        tokenizer=None,
        max_model_len=1024,
    )
    # first activation: 6 s of wall time in steps, of which the engine had its core for 3 s
    first = [_stats(2.0, 1.0), _stats(6.0, 3.0)]
    entry.count_engine_time(None, first[0])
    entry.count_engine_time(first[0], first[1])
    # a second activation starts its counters again from zero
    entry.count_engine_time(None, _stats(2.0, 2.0))
    entry.num_served = 2 * MIN_SERVED_FOR_PROFILE
    assert entry.step_seconds == 8.0 and entry.busy_seconds == 5.0
    assert entry.profile().busy_s_per_request == 5.0 / entry.num_served
