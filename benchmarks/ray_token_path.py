"""What a token stream from another Ray node costs per token, two ways.

A local multi-node Ray cluster (``ray.cluster_utils.Cluster``: a head node and a second node, on
this machine) and a node agent (a Ray actor pinned to the second node by a custom resource). The
agent produces ``--tokens`` timestamps every ``--gap`` seconds (a fast decode) and the driver (the
would-be API process) receives them:
- one Ray object per token (a streaming generator task): every token is an object in Ray's
  object store, resolved by the driver;
- a ZMQ PUSH socket the agent connects to a PULL socket the driver binds (what prism's workers
  already use locally): Ray only starts the agent.
Per token: receive time minus send time (one clock: the nodes share this machine), p50 and p99.
The target: <= 1 ms p99 added per token at low load.

Needs ``ray`` (not a dependency of prism-serve yet) beside prism-serve's environment, e.g. a venv
with ``pip install "ray==2.*" pyzmq torch==2.13.0`` run with ``PYTHONPATH=src``.

    python benchmarks/ray_token_path.py [--tokens 400] [--gap 0.002] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from common import machine_info


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--gap", type=float, default=0.002, help="seconds between tokens")
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()
    try:
        import ray
        import zmq
        from ray.cluster_utils import Cluster
    except ImportError as e:
        raise SystemExit(f"needs ray and pyzmq: pip install 'ray==2.*' pyzmq ({e})") from None
    print(machine_info()["line"])
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "resources": {"head": 1}})
    cluster.add_node(num_cpus=1, resources={"node_b": 1})
    ray.init(address=cluster.address, logging_level="ERROR")
    cluster.wait_for_nodes()

    @ray.remote(num_cpus=0, resources={"node_b": 1})
    class Agent:
        def node(self) -> str:
            return ray.get_runtime_context().get_node_id()

        def stream(self, n: int, gap: float):
            for _ in range(n):
                time.sleep(gap)
                yield time.time()

        def push(self, address: str, n: int, gap: float) -> int:
            sock = zmq.Context.instance().socket(zmq.PUSH)
            sock.connect(address)
            for _ in range(n):
                time.sleep(gap)
                sock.send(json.dumps(time.time()).encode())
            sock.send(b"null")
            sock.close(linger=1000)
            return n

    def summary(lat: list[float]) -> str:
        p50, p99 = np.percentile(np.array(lat) * 1e3, [50, 99])
        return f"p50 {p50:.3f} ms, p99 {p99:.3f} ms ({len(lat)} tokens)"

    try:
        agent = Agent.remote()
        here, there = ray.get_runtime_context().get_node_id(), ray.get(agent.node.remote())
        print(f"driver on node {here[:8]}, agent on node {there[:8]} (different nodes: {here != there})")
        pull = zmq.Context.instance().socket(zmq.PULL)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        for rep in range(args.repeats):
            lat = []
            for ref in agent.stream.options(num_returns="streaming").remote(args.tokens, args.gap):
                lat.append(time.time() - ray.get(ref))
            print(f"run {rep + 1}: one Ray object per token: {summary(lat)}")
            done = agent.push.remote(f"tcp://127.0.0.1:{port}", args.tokens, args.gap)
            lat = []
            while (sent := json.loads(pull.recv())) is not None:
                lat.append(time.time() - sent)
            ray.get(done)
            print(f"run {rep + 1}: ZMQ from the agent:       {summary(lat)}")
        pull.close()
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    main()
