"""Devices on several nodes of a Ray cluster (runtime/cluster.py), on a real local multi-node Ray
cluster (``ray.cluster_utils.Cluster``: a head node and a second node as separate raylets on this
machine). Node agents are real Ray actors, workers real processes they start, and tokens come back
over the workers' TCP sockets; the models are the real SmolLM2-135M-Instruct and a synthetic one.

The tests run in file order on one cluster: the node-loss and node-join tests change it."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import uuid

import pytest

from prism_serve.config import PolicyConfig
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.errors import WorkerDiedError
from prism_serve.memory.vmm import parse_size
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec
from tests.conftest import local_ray_cluster

from .conftest import LoopThread, Runtime, collect, wait_until

pytest.importorskip("ray")


def one_device() -> list[DeviceSpec]:
    """Every node's devices (built by its agent, on that node)."""
    return [DeviceSpec("cpu:0", parse_size("1536MiB"), (), 1)]


@pytest.fixture(scope="module")
def cluster():
    with local_ray_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def rt(cluster):
    from prism_serve.runtime.cluster import RayNodes

    ns = f"raytest{uuid.uuid4().hex[:8]}"
    loop = LoopThread()
    nodes = RayNodes(cluster.address, one_device, ns, poll_interval_s=0.2)
    devices = nodes.connect()
    models = [
        ModelSpec(
            "smol", ttft_slo=30.0, tpot_slo=2.0, engine=EngineConfig(dtype="float32", max_model_len=512)
        ),
        ModelSpec(
            "tiny",
            source="random:smollm2-135m",
            ttft_slo=30.0,
            tpot_slo=2.0,
            engine=EngineConfig(max_model_len=512),
        ),
    ]
    # no prewarming: the startup fill would race the tests' loads on chosen devices
    c = Controller(
        devices,
        models,
        PolicyConfig(tick_interval_s=0.2, knobs={"prewarm": False}),
        namespace=ns,
        nodes=nodes,
    )
    loop.run(c.start())
    runtime = Runtime(c, loop)
    yield runtime
    runtime.run(c.stop())
    loop.close()
    assert shm_files(f"{ns}.n0") == [], "the live node's agent left shared memory behind"
    for f in shm_files(ns):  # a lost node's files (on a real cluster they went with its machine)
        import os

        os.unlink(f)


def shm_files(ns: str) -> list[str]:
    return glob.glob(f"/dev/shm/prism-*-{ns}*")


def tokens(rt: Runtime, model: str, max_tokens: int = 8, **kw) -> list[int]:
    _, deltas = rt.generate(model, max_tokens=max_tokens, ignore_eos=True, **kw)
    return [t for d in deltas for t in d.token_ids]


def status(rt: Runtime) -> dict[str, tuple[str, str | None]]:
    return {s.model: (s.state, s.device) for s in rt.c.status()}


def test_every_node_caches_the_weights_and_serves_on_its_devices(rt: Runtime) -> None:
    c = rt.c
    assert sorted(c.devices) == ["n0/cpu:0", "n1/cpu:0"]
    # each node read every model into its own host cache (its own namespace), once
    for node in ("n0", "n1"):
        files = [f for f in shm_files(f"{c.namespace}.{node}") if "prism-weights-" in f]
        assert len([f for f in files if not f.endswith(".tok.json")]) == 2, files
    rt.run(c.load("smol", "n1/cpu:0"))
    rt.run(c.load("tiny", "n0/cpu:0"))
    assert status(rt) == {"smol": ("active", "n1/cpu:0"), "tiny": ("active", "n0/cpu:0")}
    remote = tokens(rt, "smol", 12)
    assert len(remote) == 12
    assert len(tokens(rt, "tiny")) == 8
    # the worker on n1 activated from n1's cache file, and the ledger mirror shows its pages
    wait_until(
        lambda: c.nodes.ledger("n1/cpu:0").snapshot().used_bytes >= c.models["smol"].cached.weight_bytes
    )
    # the same greedy request on the other node gives the same tokens
    assert rt.run(c.unload("smol"))
    rt.run(c.load("smol", "n0/cpu:0"))
    assert tokens(rt, "smol", 12) == remote
    assert rt.run(c.unload("smol"))


def test_concurrent_streams_from_two_nodes(rt: Runtime) -> None:
    c = rt.c
    rt.run(c.load("smol", "n1/cpu:0"))

    async def both() -> list[tuple[str, list]]:
        params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
        return await asyncio.gather(
            collect(c, "smol", rt.chat("smol"), params), collect(c, "tiny", rt.chat("tiny"), params)
        )

    for _, deltas in rt.run(both()):
        assert sum(len(d.token_ids) for d in deltas) == 16
        assert deltas[-1].finished


def test_a_worker_killed_on_another_node_is_noticed_and_replaced(rt: Runtime) -> None:
    c = rt.c
    victim = c.models["smol"].worker
    assert victim.device.name == "n1/cpu:0"
    before = {w.worker_id: w for w in c.pool.on_device("n1/cpu:0")}
    # the nodes share this machine: a crash of every worker on n1 (the serving one and the idle
    # spare; with the spare alive the device would still have its one worker, and none would start)
    for w in before.values():
        os.kill(w.pid, signal.SIGKILL)
    wait_until(lambda: not set(before) & set(c.pool.workers))  # n1's agent's poll reported the exits
    # the model lost its engine; n1's agent started a replacement worker
    assert c.models["smol"].worker is not victim
    wait_until(lambda: {w.worker_id for w in c.pool.idle("n1/cpu:0")} - set(before))
    # served again (activated anew wherever the policy puts it)
    assert len(tokens(rt, "smol", 4)) == 4
    rt.run(c.unload("smol"))
    rt.run(c.load("smol", "n1/cpu:0"))


def test_a_lost_node_fails_its_streams_with_503_and_its_model_serves_again_elsewhere(
    rt: Runtime, cluster
) -> None:
    c = rt.c
    assert status(rt)["smol"] == ("active", "n1/cpu:0")
    assert status(rt)["tiny"] == ("active", "n0/cpu:0")
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)

    async def lose_node_mid_request() -> tuple[BaseException | None, list]:
        lost = asyncio.create_task(collect(c, "smol", rt.chat("smol"), params))
        short = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
        other = asyncio.create_task(collect(c, "tiny", rt.chat("tiny"), short))
        while not len(c.requests) or all(r.worker is None for r in c.requests.in_flight()):
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)  # both streaming
        await asyncio.get_running_loop().run_in_executor(None, cluster.remove_node, cluster.second)
        error = None
        try:
            await lost
        except BaseException as e:  # the test inspects it
            error = e
        return error, (await other)[1]

    error, other = rt.run(lose_node_mid_request(), timeout=120)
    assert isinstance(error, WorkerDiedError) and error.status_code == 503, error
    assert "n1" in str(error)
    # the other node's stream was not touched
    assert sum(len(d.token_ids) for d in other) == 60 and other[-1].finished
    assert sorted(c.devices) == ["n0/cpu:0"]
    # the model left with its node (the policy may already have placed it again, on n0)
    assert status(rt)["smol"][1] in (None, "n0/cpu:0")
    # the next request is served on the node that is left
    assert len(tokens(rt, "smol", 4)) == 4
    assert status(rt)["smol"] == ("active", "n0/cpu:0")
    assert all(not w.device.name.startswith("n1/") for w in c.pool.workers.values())


def test_a_node_that_joins_is_used(rt: Runtime, cluster) -> None:
    c = rt.c
    cluster.add_node(num_cpus=1)
    wait_until(lambda: "n2/cpu:0" in c.devices, 60)
    assert shm_files(f"{c.namespace}.n2"), "the new node's cache was not filled"
    # the lost node's agent was killed with its cache files in this machine's /dev/shm; the new
    # node's agent (the same machine here) removed them
    assert not [f for f in shm_files(f"{c.namespace}.n1") if "prism-weights-" in f]
    assert rt.run(c.unload("tiny"))
    rt.run(c.load("tiny", "n2/cpu:0"))
    assert len(tokens(rt, "tiny", 6)) == 6
    assert status(rt)["tiny"] == ("active", "n2/cpu:0")


def test_a_node_agent_that_cannot_start_is_a_clear_cluster_error(cluster) -> None:
    from prism_serve.runtime.cluster import ClusterError, RayNodes

    def missing_cores() -> list[DeviceSpec]:  # built on each node: this machine has no core 10000
        return [DeviceSpec("cpu:0", parse_size("1GiB"), (10_000,), 1)]

    with pytest.raises(
        ClusterError, match=r"agent did not start: .*DeviceConfigError: cpu:0: cores \[10000\]"
    ):
        RayNodes(cluster.address, missing_cores, f"raybad{uuid.uuid4().hex[:8]}").connect()
