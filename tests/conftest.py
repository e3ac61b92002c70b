from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.weights import LoadedWeights, load_weights, save_hf_dir
from tests.workload.trace_data import TraceSet, find_traces

# every cluster snapshot the runtime builds from what changed is compared with a fresh build (in
# this process and in the servers the tests start, which inherit it): runtime/state.py Snapshots
os.environ.setdefault("PRISM_CHECK_SNAPSHOTS", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def smollm() -> LoadedWeights:
    """The real SmolLM2-135M-Instruct weights, loaded once for the whole session."""
    return load_weights("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def smollm_hf(smollm: LoadedWeights, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Those weights written once as an HF directory (fp32 safetensors, configs, tokenizer), for
    every test that needs a checkpoint on disk (vLLM's engine, PEFT's adapters). Its files are
    read-only: a test that must change a checkpoint writes its own."""
    path = tmp_path_factory.mktemp("smollm2-hf") / "smollm2-135m"
    save_hf_dir(smollm, path)
    for f in path.iterdir():
        os.chmod(f, 0o444)
    return path


@pytest.fixture(scope="session")
def make_engine(smollm: LoadedWeights):
    """Build an engine on the shared SmolLM2 weights with any EngineConfig overrides: float32 unless
    they say otherwise (``auto`` is bfloat16 on a CPU with native bf16 matmuls, and greedy outputs
    compared across batch shapes are exact only in float32)."""

    def make(**overrides) -> LLMEngine:
        return LLMEngine(EngineConfig(**{"dtype": "float32", **overrides}), weights=smollm)

    return make


@pytest.fixture(scope="session")
def engine(make_engine) -> LLMEngine:
    """A default fp32 engine shared by read-only tests (they must leave it idle)."""
    return make_engine()


def run_to_completion(engine: LLMEngine) -> dict:
    """Step until idle; the final RequestOutput of each request by id."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.req_id] = out
    return final


@pytest.fixture(scope="session")
def traces() -> TraceSet:
    """The full traces when present, else the committed excerpts (tests/data/traces): trace tests
    never skip for want of trace files."""
    return find_traces()


@contextlib.contextmanager
def local_ray_cluster() -> Iterator[Any]:
    """A real two-node Ray cluster on this machine (``ray.cluster_utils.Cluster``: a head node and a
    second node as separate raylets, one CPU each), shut down after, this process's Ray driver
    first. Every node Ray starts from this process (the head, the second, any a test adds)
    installs a SIGTERM handler that exits with status 1 after killing its processes; the test
    process keeps its own handlers."""
    import ray
    from ray.cluster_utils import Cluster

    from prism_serve.runtime.cluster import keep_signal_handlers

    def keeping_handlers(start):
        def call(*args, **kwargs):
            with keep_signal_handlers():
                return start(*args, **kwargs)

        return call

    cluster = keeping_handlers(Cluster)(
        initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
    )
    cluster.add_node = keeping_handlers(cluster.add_node)
    try:
        cluster.second = cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()
