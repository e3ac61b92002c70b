"""The device lower bound (sim/bound.py): each part on workloads where it is known by hand, the
per-request floors against the cost model's own step times, and the bound against simulated runs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from prism_serve.cli import main
from prism_serve.sim import HARDWARE, ModelSLO, RooflineCostModel, SimConfig, SimConfigError, model_shape
from prism_serve.sim.bound import _disjoint_weight, lower_bound
from prism_serve.sim.sweep import Experiment, run_point
from prism_serve.workload import Workload

from .helpers import loose, poisson, served

H100 = HARDWARE["h100"]


def _bound(models, workload, hw=H100, max_num_seqs=256, **kw):
    return lower_bound(models, workload, hw, RooflineCostModel(hw), max_num_seqs=max_num_seqs, **kw)


def _workload(rows: list[tuple[float, int, int, int]], names: list[str]) -> Workload:
    t, m, p, o = (np.array(c) for c in zip(*rows, strict=True))
    return Workload(t, m, p, o, names)


def test_two_big_models_need_two_devices_only_when_their_requests_share_a_window():
    # 32B weights in bf16 (~65 GB) fit one h100's usable 77 GB, two do not
    ms = [served("a", "qwen2.5-32b"), served("b", "qwen2.5-32b")]
    names = [m.name for m in ms]
    apart = _workload([(1.0, 0, 512, 64), (4.0, 0, 512, 64), (12.0, 1, 512, 64), (25.0, 0, 512, 64)], names)
    together = _workload([(1.0, 0, 512, 64), (4.0, 1, 512, 64), (12.0, 1, 512, 64)], names)
    b_apart, b_together = _bound(ms, apart), _bound(ms, together)
    assert b_apart.memory_devices == 1 and b_apart.devices == 1
    assert b_together.memory_devices == 2 and b_together.devices == 2
    assert b_together.memory_peak_start_s == 0.0
    kv = ms[0].spec.kv_bytes_per_token * (512 + 64 - 1)
    assert b_together.memory_peak_bytes == 2 * (ms[0].spec.weight_bytes + kv)
    # a window long enough to hold both of the "apart" requests puts them together again
    assert _bound(ms, apart, memory_window_s=20.0).memory_devices == 2


def test_memory_counts_each_models_largest_request_of_the_window():
    m = served("a")
    w = _workload([(0.0, 0, 100, 10), (1.0, 0, 4000, 96), (2.0, 0, 50, 5)], ["a"])
    b = _bound([m], w)
    assert b.memory_peak_bytes == m.spec.weight_bytes + m.spec.kv_bytes_per_token * (4000 + 96 - 1)


def test_memory_counts_a_windowed_models_window_not_its_length_in_its_windowed_layers():
    """Gemma 3 1B: 4 global layers of 26 and a 512-token window. A request of 4095 tokens fed holds
    them all in the global layers (one group of 4), and 512 in the 6 windowed groups of 4."""
    m = served("g", "gemma-3-1b")
    w = _workload([(0.0, 0, 4000, 96)], ["g"])
    per_group = m.spec.kv_bytes_per_token * 4 // 26
    assert _bound([m], w).memory_peak_bytes == m.spec.weight_bytes + per_group * (4095 + 6 * 512)
    short = _workload([(0.0, 0, 300, 12)], ["g"])  # within the window: every group holds every token
    assert _bound([m], short).memory_peak_bytes == m.spec.weight_bytes + per_group * 7 * 311


def test_compute_bound_grows_linearly_with_the_requests_of_a_window():
    m = served("a")
    cost = RooflineCostModel(H100)
    flops, reads = cost.request_floor(m.spec, 1, 2048, 512, 256)
    per_request = max(flops, reads)  # one model: its FLOP floor (prefill-heavy) or its weight reads

    def bound(n: int):
        w = _workload([(0.5 * i / n, 0, 2048, 512) for i in range(n)], ["a"])
        return _bound([m], w, compute_window_s=1.0)

    b1, b10, b40 = bound(100), bound(1000), bound(4000)
    assert b1.compute_peak_s == pytest.approx(100 * per_request)
    assert b10.compute_peak_s == pytest.approx(10 * b1.compute_peak_s)
    assert b40.compute_peak_s == pytest.approx(40 * b1.compute_peak_s)
    assert b40.compute_devices == math.ceil(b40.compute_peak_s / 1.0) > b10.compute_devices > 1
    assert b40.devices == b40.compute_devices  # one 8B model fits one device: compute decides


def test_weight_reads_add_up_only_for_requests_too_far_apart_to_share_a_step():
    # feasible intervals of 0.5 + (O - 1) * 0.05 s: at most 5 s long, so arrivals 10 s apart never
    # overlap, while arrivals 0.1 s apart always do
    m = served("a")
    slos = {"a": ModelSLO(0.5, 0.05)}
    cost = RooflineCostModel(H100)
    read = cost.request_floor(m.spec, 1, 16, 1, 1)[1]  # one weight read
    outputs = [100, 60, 80]
    apart = _workload([(10.0 * i, 0, 16, o) for i, o in enumerate(outputs)], ["a"])
    together = _workload([(0.1 * i, 0, 16, o) for i, o in enumerate(outputs)], ["a"])
    assert _bound([m], apart, slos=slos).compute_peak_s == pytest.approx(sum(outputs) * read)
    assert _bound([m], together, slos=slos).compute_peak_s == pytest.approx(max(outputs) * read)
    # without SLOs: perfect batching (every step shared by max_num_seqs requests) or the FLOPs
    flops, reads = cost.request_floor(m.spec, 1, 16, np.array(outputs), 256)
    assert reads.sum() == pytest.approx(sum(outputs) * read / 256)
    assert _bound([m], apart).compute_peak_s == pytest.approx(max(flops.sum(), reads.sum()))
    # requests of different models never share a step, whenever they arrive
    two = [served("a"), served("b")]
    both = _workload([(0.0, 0, 16, 100), (0.1, 1, 16, 80)], ["a", "b"])
    b = _bound(two, both, slos={"a": slos["a"], "b": slos["a"]})
    assert b.compute_peak_s == pytest.approx(180 * read)


def test_the_largest_weight_of_disjoint_intervals_not_the_most_intervals():
    def best(*rows: tuple[float, float, float]) -> float:
        return _disjoint_weight(*(np.array(c, dtype=np.float64) for c in zip(*rows, strict=True)))

    # two short requests inside a long one: the long one alone outweighs them
    assert best((0, 10, 10), (1, 2, 3), (3, 4, 3)) == 10
    assert best((0, 10, 5), (1, 2, 3), (3, 4, 3)) == 6
    # touching ends cannot hold one step of positive length for both
    assert best((0, 1, 2), (1, 2, 2), (1.5, 3, 1)) == 4
    assert best((0, 1, 2)) == 2


def test_a_model_with_tp_4_needs_four_devices_even_when_idle_elsewhere():
    big, small = served("big", "qwen2.5-32b", tp=4), served("small", "llama-3.2-1b")
    w = _workload([(0.0, 0, 128, 16), (30.0, 1, 128, 16)], ["big", "small"])
    b = _bound([big, small], w)
    assert b.tp_devices == 4 and b.devices >= 4 and b.memory_devices == 1
    # without its requests the TP model asks for nothing
    assert _bound([big, small], w.only("small")).devices == 1


@pytest.mark.parametrize(
    "hw_name, shape, dtype", [("h100", "llama-3.1-8b", 2), ("cpu-smollm2", "smollm2-135m", 4)]
)
@pytest.mark.parametrize("prompt, output", [(1, 1), (7, 40), (512, 64), (3000, 300)])
def test_request_floors_are_below_the_steps_that_serve_the_request_alone(
    hw_name, shape, dtype, prompt, output
):
    hw = HARDWARE[hw_name]
    cost = RooflineCostModel(hw)
    spec = model_shape(shape, dtype)
    # alone: the prompt in one step, then output - 1 decodes of a growing context
    steps = cost.prefill_time(spec, 1, prompt)
    if output > 1:
        steps += float(cost.decode_steps(spec, 1, 1, prompt, output - 1).sum())
    flops, reads = cost.request_floor(spec, 1, prompt, output, 1)
    assert 0 < flops <= steps and 0 < reads <= steps
    # one weight read per sampled token, shared by max_num_seqs requests when batched
    assert cost.request_floor(spec, 1, prompt, output, 8)[1] == pytest.approx(reads / 8)


def test_tp_splits_time_but_not_device_seconds():
    cost = RooflineCostModel(H100)
    spec = model_shape("llama-3.1-70b")
    one = cost.request_floor(spec, 1, 1000, 100, 256)
    four = cost.request_floor(spec, 4, 1000, 100, 256)
    assert four == pytest.approx(one)


@pytest.mark.parametrize("policy", ["prism", "static-partition"])
def test_the_bound_is_at_most_what_a_simulated_policy_needs(policy):
    # four 14B models (~30 GB each) busy in every window: two devices by memory at least
    ms = [served(f"m{i}", "qwen2.5-14b") for i in range(4)]
    w = poisson([m.name for m in ms], rate=0.5, duration=40, prompt=(64, 1024), output=(8, 128), seed=2)
    exp = Experiment(ms, w, loose(ms), SimConfig(num_devices=1), slo_scale=1.0)
    b = _bound(ms, w, max_num_seqs=exp.config.engine.max_num_seqs, slos=loose(ms))
    assert b.devices == b.memory_devices == 2
    # no count below the bound's reaches 99%: the fewest that does is at least the bound
    n = next((n for n in range(1, 5) if run_point(exp, policy, "gpus", n)["ttft_attainment"] >= 0.99), None)
    assert n is not None and b.devices <= n


@pytest.mark.parametrize("policy", ["prism", "static-partition"])
def test_the_slo_compute_bound_is_at_most_what_a_simulated_policy_needs(policy):
    # eight 1B models (one device by memory) decoding long outputs against a tight TPOT: their
    # weight reads add up on a shared device, so compute decides, which perfect batching misses
    ms = [served(f"m{i}", "llama-3.2-1b") for i in range(8)]
    w = poisson([m.name for m in ms], rate=2, duration=40, prompt=(16, 256), output=(200, 400), seed=3)
    slos = {m.name: ModelSLO(0.5, 0.004) for m in ms}
    exp = Experiment(ms, w, slos, SimConfig(num_devices=1), slo_scale=1.0)
    b = _bound(ms, w, max_num_seqs=exp.config.engine.max_num_seqs, slos=slos, compute_window_s=20.0)
    batched = _bound(ms, w, max_num_seqs=exp.config.engine.max_num_seqs, compute_window_s=20.0)
    assert b.memory_devices == batched.devices == 1 and b.devices == b.compute_devices >= 2
    # the bound is for serving every request within both SLOs
    for n in range(1, 2 * b.devices + 1):
        r = run_point(exp, policy, "gpus", n)
        if r["ttft_attainment"] == r["tpot_attainment"] == 1.0:
            break
    else:
        pytest.fail(f"{policy} missed SLOs on {n} devices")
    assert b.devices <= n


def test_rejects_bad_windows_and_unknown_models():
    m = served("a")
    w = _workload([(0.0, 0, 10, 10)], ["a"])
    with pytest.raises(SimConfigError, match="memory_window_s"):
        _bound([m], w, memory_window_s=0.0)
    with pytest.raises(SimConfigError, match="compute_window_s"):
        _bound([m], w, compute_window_s=float("inf"))
    with pytest.raises(SimConfigError, match="not served"):
        _bound([served("b")], _workload([(0.0, 0, 10, 10)], ["a"]))
    with pytest.raises(SimConfigError, match="no SLOs"):
        _bound([m], w, slos={"b": ModelSLO(1.0, 0.1)})
    assert _bound([m], w.select(np.zeros(1, dtype=bool))).devices == 1


def test_find_gpus_prints_the_bound_and_each_policys_ratio(tmp_path, capsys, traces):
    rc = main(
        [
            "sim", "--setup", "paper-8", "--gpus", "2", "--duration", "30", "--total-rate", "1",
            "--policies", "static-partition", "--find-gpus", "0.5", "--bound-window", "5",
            "--out", str(tmp_path), "--traces", str(traces.root),
        ]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    body = json.loads((tmp_path / "results.json").read_text())
    bound = body["lower_bound"]
    assert bound["memory_window_s"] == 5.0 and bound["compute_window_s"] == 60.0
    assert bound["devices"] == max(1, bound["memory_devices"], bound["compute_devices"], bound["tp_devices"])
    line = next(x for x in out.splitlines() if x.startswith("lower bound:"))
    assert f"lower bound: {bound['devices']} devices (memory {bound['memory_devices']} in the 5 s" in line
    n = body["gpus_needed"]["static-partition"]
    ratio = body["ratio_to_bound"]["static-partition"]
    if n is None:
        assert ratio is None and "more than" in out
    else:
        assert ratio == pytest.approx(n / bound["devices"]) and f"({ratio:.2f}x the lower bound)" in out
    assert out.index("lower bound:") < out.index("static-partition:")
