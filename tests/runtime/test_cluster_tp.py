"""A tensor parallel model on a real local multi-node Ray cluster (``ray.cluster_utils.Cluster``:
a head node and a second node as separate raylets on this machine), two CPU devices on each: its
two ranks run on two devices of one node, never across nodes, each activated from that node's own
host cache, and give the greedy tokens of the same weights served whole (a synthetic shape with
random weights, fp32)."""

from __future__ import annotations

import uuid

import pytest

from prism_serve.config import PolicyConfig
from prism_serve.engine.config import EngineConfig
from prism_serve.memory.vmm import parse_size
from prism_serve.runtime.controller import Controller
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec
from tests.conftest import local_ray_cluster

from .conftest import LoopThread, Runtime

pytest.importorskip("ray")


def two_devices() -> list[DeviceSpec]:
    """Every node's devices (built by its agent, on that node)."""
    return [DeviceSpec(f"cpu:{i}", parse_size("1GiB"), (), 1) for i in range(2)]


@pytest.fixture(scope="module")
def rt():
    with local_ray_cluster() as cluster:
        yield from _runtime(cluster)


def _runtime(cluster):
    """A controller on ``cluster``'s nodes, stopped after its tests."""
    from prism_serve.runtime.cluster import RayNodes

    loop = LoopThread()
    ns = f"raytp{uuid.uuid4().hex[:8]}"
    nodes = RayNodes(cluster.address, two_devices, ns, poll_interval_s=0.2)
    engine = EngineConfig(dtype="float32", max_model_len=256)
    models = [
        ModelSpec("tiny-tp2", source="random:smollm2-135m", engine=engine, tp=2),
        ModelSpec("tiny", source="random:smollm2-135m", engine=engine),
    ]
    c = Controller(
        nodes.connect(),
        models,
        PolicyConfig(tick_interval_s=0.2, knobs={"prewarm": False}),
        namespace=ns,
        nodes=nodes,
    )
    loop.run(c.start())
    yield Runtime(c, loop)
    loop.run(c.stop())
    loop.close()


def test_the_ranks_stay_on_one_node_and_match_the_whole_model(rt: Runtime) -> None:
    c = rt.c
    assert sorted(c.devices) == ["n0/cpu:0", "n0/cpu:1", "n1/cpu:0", "n1/cpu:1"]
    want = [t for d in rt.generate("tiny", "abc", max_tokens=8, ignore_eos=True)[1] for t in d.token_ids]
    rt.run(c.unload("tiny"))
    got = [t for d in rt.generate("tiny-tp2", "abc", max_tokens=8, ignore_eos=True)[1] for t in d.token_ids]
    m = c.models["tiny-tp2"]
    nodes = {d.split("/")[0] for d in m.devices}
    assert len(m.devices) == 2 and len(nodes) == 1, m.devices
    assert [h.device.name for h in m.ranks] == list(m.devices)
    assert got == want
    assert rt.run(c.unload("tiny-tp2"))
