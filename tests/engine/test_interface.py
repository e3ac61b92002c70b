"""Both engines a worker drives, both KV memories behind them, and both engine slots that build
them have every member of the interface runtime/worker.py uses (engine/interface.py,
runtime/engine_slot.py), and the worker itself tells the engines apart nowhere else than where it
opens its slot. vLLM's side is checked without vLLM: its classes import without it (vLLM loads only
when an engine is built)."""

from __future__ import annotations

import ast
import inspect
import typing

import pytest

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.interface import WorkerEngine, WorkerKV
from prism_serve.engine.llm_engine import LLMEngine
from prism_serve.engine.models.config import PRESETS
from prism_serve.engine.vllm_engine import VllmEngine
from prism_serve.engine.weights import random_weights
from prism_serve.memory.kv_pool import ElasticKVPool
from prism_serve.runtime import worker
from prism_serve.runtime.builtin_slot import BuiltinSlot
from prism_serve.runtime.engine_slot import EngineSlot
from prism_serve.runtime.vllm_slot import VllmMemory, VllmSlot


def members(protocol: type) -> tuple[set[str], set[str]]:
    """(methods and properties, data attributes) of a Protocol."""
    names = {n for n, v in vars(protocol).items() if callable(v) or isinstance(v, property)}
    names -= {n for n in vars(typing.Protocol)} | {"__init__", "__subclasshook__"}
    return {n for n in names if not n.startswith("_")}, set(typing.get_type_hints(protocol))


def assigned_in_init(cls: type) -> set[str]:
    src = inspect.getsource(cls.__init__)
    return {line.split("self.", 1)[1].split("=")[0].split(":")[0].strip()
            for line in src.splitlines() if line.strip().startswith("self.") and "=" in line}  # fmt: skip


@pytest.mark.parametrize("cls", [LLMEngine, VllmEngine])
def test_engines_have_every_member_a_worker_uses(cls: type) -> None:
    calls, data = members(WorkerEngine)
    assert calls and data
    missing = {n for n in calls if not hasattr(cls, n)}
    assert not missing, f"{cls.__name__} lacks {missing}"
    have = assigned_in_init(cls) | {n for n in data if hasattr(cls, n)}
    assert data <= have, f"{cls.__name__} never sets {data - have}"


@pytest.mark.parametrize("cls", [ElasticKVPool, VllmMemory])
def test_kv_memories_have_every_member_a_worker_uses(cls: type) -> None:
    calls, _ = members(WorkerKV)
    assert {"close", "shrink_buffer", "num_used_blocks"} <= calls
    assert not {n for n in calls if not hasattr(cls, n) and n not in assigned_in_init(cls)}


def test_a_built_engine_has_the_data_attributes() -> None:
    weights = random_weights(PRESETS["smollm2-135m"], seed=0)
    engine = LLMEngine(EngineConfig(dtype="float32", kv_cache_bytes=8 * 2**20), weights=weights)
    try:
        for name in members(WorkerEngine)[1]:
            getattr(engine, name)
    finally:
        engine.close()


@pytest.mark.parametrize("cls", [BuiltinSlot, VllmSlot])
def test_engine_slots_have_every_member_a_worker_uses(cls: type) -> None:
    calls, data = members(EngineSlot)
    assert {"activate", "release", "build_ahead", "poll"} <= calls and {"kind", "needs_tokenizer"} <= data
    missing = {n for n in calls | data if not hasattr(cls, n)}
    assert not missing, f"{cls.__name__} lacks {missing}"
    assert {BuiltinSlot.kind, VllmSlot.kind} == {"builtin", "vllm"}


def test_the_worker_tells_the_engines_apart_only_where_it_opens_its_slot() -> None:
    """Every mention of vLLM in runtime/worker.py is in ``Worker.__init__`` (which slot to open)
    or ``main`` (the --engine flag): the rest of the worker runs any engine the same way."""
    tree = ast.parse(inspect.getsource(worker))
    allowed = [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef) and node.name in ("__init__", "main")
    ]
    inside = {id(n) for f in allowed for n in ast.walk(f)}
    docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}  # text, not code
    mentions = []
    for node in ast.walk(tree):
        if id(node) in inside or id(node) in docstrings:
            continue
        if isinstance(node, ast.Name):
            name = node.id
        elif isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            name = node.value
        else:
            continue
        if "vllm" in name.lower():
            mentions.append((node.lineno, name))
    assert mentions == [], mentions
    assert any("vllm" in ast.unparse(f).lower() for f in allowed)  # the check sees what it looks for
