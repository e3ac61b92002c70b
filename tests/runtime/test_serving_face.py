"""The runtime's face to the HTTP layer (runtime/serving.py): the controller answers every call of
``ServingRuntime`` with the same parameters, so api/ typed against the face runs on the controller."""

from __future__ import annotations

import inspect

from prism_serve.runtime.controller import Controller
from prism_serve.runtime.serving import ServingRuntime


def _members(cls: type) -> dict[str, object]:
    return {n: v for n, v in vars(cls).items() if not n.startswith("_")}


def test_the_controller_implements_the_serving_face():
    face = _members(ServingRuntime)
    assert {"tokenizer", "status", "adapter", "adapters", "is_active", "generate", "running"} <= set(face)
    for name, member in face.items():
        mine = inspect.getattr_static(Controller, name, None)
        assert mine is not None, f"Controller lacks {name}"
        if isinstance(member, property):
            assert isinstance(mine, property), f"Controller.{name} is not a property"
            continue
        want = list(inspect.signature(member).parameters.values())
        got = list(inspect.signature(mine).parameters.values())
        assert [(p.name, p.kind, p.default) for p in want] == [(p.name, p.kind, p.default) for p in got], name
