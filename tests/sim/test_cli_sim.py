"""`prism sim` and `prism workload` end to end on tiny workloads (simulated; seconds, not minutes)."""

from __future__ import annotations

import json

from prism_serve.cli import main
from prism_serve.sim import ServedModel, SimConfig, model_shape
from prism_serve.sim.sweep import Experiment, find_gpus
from prism_serve.workload import read_jsonl

from .helpers import loose, poisson


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


def test_find_gpus_bisects_to_the_fewest_devices():
    ms = [ServedModel(f"m{i}", model_shape("llama-3.1-8b")) for i in range(4)]
    w = poisson([m.name for m in ms], rate=0.5, duration=60, seed=1)
    exp = Experiment(ms, w, loose(ms), SimConfig(num_devices=1), slo_scale=1.0)
    # dedicated needs one GPU per model to serve everything
    n, tried = find_gpus(exp, "dedicated", 0.99, 8)
    assert n == 4
    assert {p["num_devices"] for p in tried} >= {3, 4}
    assert all(p["ttft_attainment"] < 0.99 for p in tried if p["num_devices"] < 4)


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
