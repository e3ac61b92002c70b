"""`prism sim` and `prism workload` end to end on tiny workloads (simulated; seconds, not minutes)."""

from __future__ import annotations

import json

from prism_serve.cli import main
from prism_serve.workload import read_jsonl

from .helpers import poisson


def test_workload_command_writes_jsonl_and_prints_stats(tmp_path, capsys, traces):
    out = tmp_path / "w.jsonl"
    rc = main(
        ["workload", "--setup", "paper-8", "--duration", "300", "--total-rate", "2", "--out", str(out),
         "--traces", str(traces.root)]
    )  # fmt: skip
    assert rc == 0
    w = read_jsonl(out)
    assert 200 < len(w) < 1000 and set(w.models) <= {f"llama-3.2-1b-0{i}" for i in range(3)} | {
        f"llama-3.2-3b-0{i}" for i in range(3)
    } | {"llama-3.1-8b-00", "llama-3.1-8b-01"}
    assert "least popular 60%" in capsys.readouterr().out


def test_sim_sweep_writes_results_plot_and_slos(tmp_path, capsys, traces):
    rc = main(
        [
            "sim", "--setup", "paper-8", "--gpus", "2", "--duration", "120", "--total-rate", "2",
            "--policies", "prism,static-partition", "--sweep", "slo", "--values", "2,8",
            "--out", str(tmp_path), "--traces", str(traces.root),
        ]
    )  # fmt: skip
    assert rc == 0
    body = json.loads((tmp_path / "results.json").read_text())
    assert body["simulated"] is True and len(body["points"]) == 4
    assert {p["policy"] for p in body["points"]} == {"prism", "static-partition"}
    for p in body["points"]:
        assert 0 <= p["ttft_attainment"] <= 1 and p["axis"] == "slo"
    # a looser SLO never lowers attainment for the same run
    prism = sorted((p["value"], p["ttft_attainment"]) for p in body["points"] if p["policy"] == "prism")
    assert prism[0][1] <= prism[1][1]
    assert (tmp_path / "sweep.png").stat().st_size < 200_000
    assert (tmp_path / "slos.json").exists()
    assert "TTFT" in capsys.readouterr().out


def test_sim_rejects_a_sweep_without_values(capsys):
    assert main(["sim", "--sweep", "rate"]) == 2
    assert "needs --values" in capsys.readouterr().err


def test_find_gpus_is_the_planners_sweep(tmp_path, capsys):
    """`prism sim --find-gpus` searches as `prism plan` does: every count from the floor up is
    simulated, and a baseline's answer is its first passing count (it could keep that assignment
    on more devices); prism's passes with the two counts above it too (tests/sim/test_plan.py)."""
    from prism_serve.sim.deployment import get_setup
    from prism_serve.workload import write_jsonl

    names = [m.name for m in get_setup("paper-8")]
    path = tmp_path / "w.jsonl"
    write_jsonl(poisson(names, rate=0.5, duration=60, seed=1), path)
    argv = ["sim", "--setup", "paper-8", "--workload", str(path), "--gpus", "12", "--find-gpus", "0.99",
            "--policies", "dedicated", "--slo-scale", "5", "--out", str(tmp_path / "out")]  # fmt: skip
    assert main(argv) == 0
    body = json.loads((tmp_path / "out" / "results.json").read_text())
    n = body["gpus_needed"]["dedicated"]
    # dedicated gives each model its own device and refuses the requests of the rest: 8 for 8 models
    assert n == 8
    tried = {p["num_devices"]: p["ttft_attainment"] for p in body["points"]}
    assert set(range(min(tried), n + 1)) <= set(tried), "a sweep, not a bisection"
    assert all(a < 0.99 for k, a in tried.items() if k < n)
    assert tried[n] >= 0.99 and max(tried) <= n + 1  # no confirming counts (one more: a batch of two)
    assert "dedicated: 8 GPUs" in capsys.readouterr().out


def test_compute_sharing_is_on_by_default_and_the_flag_turns_it_off(tmp_path, traces):
    def run(*flags):
        out = tmp_path / ("off" if flags else "on")
        argv = ["sim", "--setup", "paper-8", "--gpus", "1", "--duration", "60", "--total-rate", "4",
                "--policies", "prism", "--sweep", "gpus", "--values", "1", "--out", str(out),
                "--traces", str(traces.root), *flags]  # fmt: skip
        assert main(argv) == 0
        (point,) = json.loads((out / "results.json").read_text())["points"]
        return point

    on, off = run(), run("--no-compute-sharing")
    assert on["compute_sharing"] is True and off["compute_sharing"] is False
    # eight models on one GPU: engines overlap, so sharing the device makes requests slower
    assert on["ttft_p50_s"] > off["ttft_p50_s"]


def test_hardware_profile_files_load_back_equal_and_drive_prism_sim(tmp_path, capsys, traces):
    """A profile file (what fit_cpu_profile.py --write saves for the machine it ran on) is read back
    equal, and `prism sim --hardware FILE.json` simulates on it: a dump of h100 gives h100's results,
    the same profile 100x slower gives lower attainment."""
    import dataclasses

    from prism_serve.sim.hardware import HARDWARE, dump_hardware, get_hardware

    same, slow = tmp_path / "same.json", tmp_path / "slow.json"
    dump_hardware(HARDWARE["h100"], same)
    assert get_hardware(str(same)) == HARDWARE["h100"]
    dump_hardware(dataclasses.replace(HARDWARE["h100"].slowed(100.0), name="slow"), slow)
    assert get_hardware(str(slow)).peak_flops == HARDWARE["h100"].peak_flops / 100
    ttft = {}
    for hw in ("h100", str(same), str(slow)):
        out = tmp_path / f"out-{len(ttft)}"
        rc = main(
            ["sim", "--setup", "paper-8", "--gpus", "2", "--duration", "120", "--total-rate", "4",
             "--policies", "static-partition", "--hardware", hw, "--out", str(out),
             "--traces", str(traces.root)]
        )  # fmt: skip
        assert rc == 0
        (point,) = json.loads((out / "results.json").read_text())["points"]
        ttft[hw] = point["ttft_attainment"]
    assert ttft["h100"] == ttft[str(same)]
    assert ttft[str(slow)] < ttft["h100"]


def test_bad_hardware_profiles_are_named_errors(tmp_path, capsys):
    import pytest

    from prism_serve.sim.errors import SimConfigError
    from prism_serve.sim.hardware import get_hardware

    with pytest.raises(SystemExit) as exit_:
        main(["sim", "--hardware", "h900"])
    assert exit_.value.code == 2
    assert "unknown hardware 'h900'" in capsys.readouterr().err
    cases = {
        "missing.json": (None, "No such file"),
        "text.json": ("not json", "is not JSON"),
        "list.json": ("[1, 2]", "must be a JSON object"),
        "extra.json": ('{"name": "x", "warp_drive": 1}', "unknown fields warp_drive"),
        "short.json": ('{"name": "x"}', "missing"),
        "negative.json": (
            '{"name": "x", "peak_flops": -1, "mem_bandwidth": 1, "host_bandwidth": 1, "link_bandwidth": 1, '
            '"memory_bytes": 1}',
            "peak_flops must be > 0",
        ),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        if text is not None:
            path.write_text(text)
        with pytest.raises(SimConfigError, match=message):
            get_hardware(str(path))
