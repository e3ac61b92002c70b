"""What the multi-node path adds to each token, side by side with a single-machine server.

One local Ray cluster (``ray.cluster_utils.Cluster``: a head node and a second node, on this
machine) stays up for the whole run. Two controllers serve the same model and the same requests,
one after the other, alternating ``--repeats`` times:
- local: a plain controller with ``--local-devices`` CPU devices of this machine (workers on IPC
  sockets; the model on cpu:0);
- ray: a controller in Ray mode (``runtime/cluster.py``) with the model on node n1, whose agent
  started the worker (a TCP socket to the controller; Ray carries no token).

Per step message of the worker: transit = the controller's receive time minus the worker's send
time (``StepOutputs.sent_at``; one clock, since every node is on this machine). Per token at the
client: the gap between consecutive tokens of a stream. p50 / p99 of each, and ray minus local.

    python benchmarks/cluster_token_path.py [--streams 1,4] [--tokens 64] [--repeats 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
import uuid
from dataclasses import replace
from pathlib import Path

import numpy as np

from common import machine_info
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.memory.vmm import parse_size
from prism_serve.runtime import messages as msg
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec


def one_device() -> list[DeviceSpec]:
    return [DeviceSpec("cpu:0", parse_size("1536MiB"), (), 1)]


async def measure(c: Controller, device: str, streams: int, tokens: int, rounds: int) -> dict:
    transit: list[float] = []
    receive = c.pool._on_message

    def timed(handle, m):  # before start(): the pool calls this with every worker message
        if isinstance(m, msg.StepOutputs) and m.outputs and m.sent_at:
            transit.append(time.time() - m.sent_at)
        receive(handle, m)

    c.pool._on_message = timed
    await c.start()
    try:
        await c.load("m", device)
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
        prompt = "Tell me a long story about the sea."

        async def stream() -> list[float]:
            seen = []
            async for _ in c.generate("m", prompt, params):
                seen.append(time.perf_counter())
            return list(np.diff(seen))

        await stream()  # warm-up
        transit.clear()
        gaps: list[float] = []
        worker = c.models["m"].worker.pid
        before = time.perf_counter(), os.times(), cpu_seconds(ray_pids()), cpu_seconds([worker])
        for _ in range(rounds):
            for g in await asyncio.gather(*(stream() for _ in range(streams))):
                gaps.extend(g)
        wall = time.perf_counter() - before[0]
        mine = os.times()
        # cores busy during the measurement: this process (controller, and Ray's driver threads in
        # Ray mode), Ray's own processes (raylets, GCS, node agents), the model's worker
        cores = {
            "controller": (mine.user + mine.system - before[1].user - before[1].system) / wall,
            "ray": (cpu_seconds(ray_pids()) - before[2]) / wall,
            "worker": (cpu_seconds([worker]) - before[3]) / wall,
        }
    finally:
        await c.stop()
    return {"transit_ms": np.array(transit) * 1e3, "gap_ms": np.array(gaps) * 1e3, "cores": cores}


def ray_pids() -> list[int]:
    """Ray's processes on this machine (raylets, GCS, its Python workers such as the node agents)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                cmd = (p / "cmdline").read_bytes()
            except OSError:
                continue
            if (
                b"raylet" in cmd
                or b"gcs_server" in cmd
                or b"default_worker.py" in cmd
                or cmd.startswith(b"ray::")
            ):
                out.append(int(p.name))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of ``pids`` (processes that exited count 0)."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


async def failover(c: Controller, cluster, lost_node, tokens: int) -> dict:
    """Model ``a`` streams from n1 and ``b`` from n0; n1's Ray node is removed mid-stream. What
    ``b``'s stream saw, what ``a``'s got, and how long until ``a`` answers again from n0."""
    await c.start()
    try:
        await c.load("a", "n1/cpu:0")
        await c.load("b", "n0/cpu:0")

        def params(max_tokens: int) -> SamplingParams:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

        async def stream(model: str, max_tokens: int) -> tuple[int, str | None]:
            got = 0
            try:
                async for d in c.generate(model, "Tell me a long story about the sea.", params(max_tokens)):
                    got += len(d.token_ids)
            except Exception as e:
                return got, f"{type(e).__name__} ({getattr(e, 'status_code', '?')})"
            return got, None

        lost = asyncio.create_task(stream("a", 4 * tokens))
        other = asyncio.create_task(stream("b", tokens))
        await asyncio.sleep(1.0)
        removed = time.perf_counter()
        await asyncio.get_running_loop().run_in_executor(None, cluster.remove_node, lost_node)
        while "n1/cpu:0" in c.devices:
            await asyncio.sleep(0.01)
        noticed = time.perf_counter()
        first = None
        async for _ in c.generate("a", "Hello", params(1)):  # while b still streams on n0
            first = time.perf_counter()
        lost_result, other_result = await lost, await other
        phases = c.models["a"].last_phases
        return {
            "lost_stream": lost_result,
            "other_stream": other_result,
            "other_expected": tokens,
            "notice_s": noticed - removed,
            "serving_again_s": first - noticed,
            "activation_s": phases.total_s if phases else None,
            "phases": str(phases),
            "a_on": c.models["a"].device,
            "tick_s": c.settings.tick_interval_s,
        }
    finally:
        await c.stop()


def pct(a: np.ndarray) -> tuple[float, float]:
    p50, p99 = np.percentile(a, [50, 99])
    return float(p50), float(p99)


def model_spec(args: argparse.Namespace) -> ModelSpec:
    """The one model both sides serve: fp32, short context, SLOs no run misses."""
    return ModelSpec(
        "m",
        source=args.model,
        ttft_slo=30.0,
        tpot_slo=2.0,
        engine=EngineConfig(dtype="float32", max_model_len=512),
    )


def local_only(args: argparse.Namespace) -> None:
    print(machine_info()["line"])
    spec = model_spec(args)
    streams = max(int(s) for s in args.streams.split(","))
    for rep in range(args.repeats):
        size = parse_size("1536MiB")
        local = [DeviceSpec(f"cpu:{i}", size, (), 1) for i in range(args.local_devices)]
        c = Controller(local, [spec], namespace=f"bench{uuid.uuid4().hex[:8]}")
        r = asyncio.run(measure(c, "cpu:0", streams, args.tokens, args.rounds))
        line = " | ".join(
            f"{what[:-3]} p50 {np.percentile(a, 50):.3f} p99 {np.percentile(a, 99):.2f} max {a.max():.1f} ms"
            for what, a in (("transit_ms", r["transit_ms"]), ("gap_ms", r["gap_ms"]))
        )
        print(f"local, {streams} streams, run {rep + 1}: {line}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", default="1,4", help="concurrent streams (comma list: one run each)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4, help="rounds of streams per measurement")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--model", default="random:smollm2-135m")
    ap.add_argument(
        "--local-devices",
        type=int,
        default=2,
        help="CPU devices of the local server (2: as many worker processes as the two Ray nodes run)",
    )
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    ap.add_argument(
        "--local-only",
        action="store_true",
        help="only the local server, once per repeat at the largest --streams (no Ray needed): its "
        "transit and gap p50 / p99 / max, to compare checkouts of this repository",
    )
    args = ap.parse_args()
    if args.local_only:
        local_only(args)
        return
    try:
        import ray
        from ray.cluster_utils import Cluster
    except ImportError as e:
        raise SystemExit(f"needs ray: pip install 'prism-serve[ray]' ({e})") from None
    from prism_serve.runtime.cluster import RayNodes

    info = machine_info()
    print(info["line"])
    spec = model_spec(args)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    second = cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    results = []
    lost = None
    try:
        for streams in [int(s) for s in args.streams.split(",")]:
            for rep in range(args.repeats):
                row = {"streams": streams, "repeat": rep + 1}
                for kind in ("local", "ray"):
                    ns = f"bench{uuid.uuid4().hex[:8]}"
                    if kind == "local":
                        local = [
                            DeviceSpec(f"cpu:{i}", parse_size("1536MiB"), (), 1)
                            for i in range(args.local_devices)
                        ]
                        c = Controller(local, [spec], namespace=ns)
                        device = "cpu:0"
                    else:
                        nodes = RayNodes(cluster.address, one_device, ns)
                        c = Controller(nodes.connect(), [spec], namespace=ns, nodes=nodes)
                        device = "n1/cpu:0"
                    r = asyncio.run(measure(c, device, streams, args.tokens, args.rounds))
                    row[kind] = {"transit_ms": pct(r["transit_ms"]), "gap_ms": pct(r["gap_ms"]),
                                 "messages": len(r["transit_ms"]), "tokens": len(r["gap_ms"]),
                                 "cores": r["cores"]}  # fmt: skip
                for what in ("transit_ms", "gap_ms"):
                    (l50, l99), (r50, r99) = row["local"][what], row["ray"][what]
                    head = f"streams {streams} run {rep + 1} {what[:-3]:>7}"
                    print(
                        f"{head}: local p50 {l50:7.3f} p99 {l99:7.3f} | ray p50 {r50:7.3f} p99 {r99:7.3f} | "
                        f"added p50 {r50 - l50:+.3f} p99 {r99 - l99:+.3f} ms"
                    )
                busy = {
                    k: " ".join(f"{n} {v:.2f}" for n, v in row[k]["cores"].items()) for k in ("local", "ray")
                }
                print(
                    f"streams {streams} run {rep + 1}   cores busy: local {busy['local']} | ray {busy['ray']}"
                )
                results.append(row)
        # last, since it changes the cluster: losing the node that serves a model
        ns = f"bench{uuid.uuid4().hex[:8]}"
        nodes = RayNodes(cluster.address, one_device, ns)
        models = [replace(spec, name="a"), replace(spec, name="b", seed=1)]
        c = Controller(nodes.connect(), models, namespace=ns, nodes=nodes)
        lost = asyncio.run(failover(c, cluster, second, args.tokens))
        print(
            f"node lost: its stream {lost['lost_stream']}; the other node's stream "
            f"{lost['other_stream'][0]}/{lost['other_expected']} tokens, error {lost['other_stream'][1]}; "
            f"noticed after {lost['notice_s']:.2f} s; model a answered again from {lost['a_on']} "
            f"{lost['serving_again_s']:.3f} s later (its activation {lost['activation_s']:.3f} s, "
            f"tick {lost['tick_s']} s)\n  {lost['phases']}"
        )
    finally:
        ray.shutdown()
        cluster.shutdown()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": info, "args": vars(args) | {"out": str(args.out)},
                                        "results": results, "failover": lost}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
