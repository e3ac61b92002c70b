"""The runtime as the HTTP layer sees it: one narrow face.

api/ serves requests through ``ServingRuntime`` and nothing else of the runtime: a model's tokenizer,
the served models and adapters, whether a model is active, and ``generate``, which streams
``Delta``s. The controller (controller.py) is what implements it; the face names the few calls and
types the serving path may rely on, so that the runtime's parts (model table, request table,
nodes, the worker wire) can change without the HTTP layer noticing.

``Delta`` is the one type of a request's output from the engine to the HTTP layer (as
``SamplingParams`` is one type of its settings): the runtime owns it, and the HTTP layer reaches
it here, not through the worker wire module.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from prism_serve.control.types import DEFAULT_ORIGIN, Origin
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.runtime.adapters import AdapterSpec
from prism_serve.runtime.messages import ActivationPhases, RequestTimings
from prism_serve.runtime.messages import TokenDelta as Delta
from prism_serve.runtime.models import UnknownModelError
from prism_serve.runtime.state import ModelStatus

__all__ = [
    "ActivationPhases",
    "AdapterSpec",
    "Delta",
    "ModelStatus",
    "RequestTimings",
    "ServingRuntime",
    "UnknownModelError",
]


class ServingRuntime(Protocol):
    """What serving a request needs of the runtime (runtime/controller.py ``Controller``)."""

    @property
    def running(self) -> bool:
        """Between a finished start and stop: requests are taken."""
        ...

    def tokenizer(self, model: str) -> Tokenizer:
        """``model``'s tokenizer (an adapter's is its base's); UnknownModelError (404) for a name
        not served."""
        ...

    def status(self) -> list[ModelStatus]:
        """One status per served model (its SLOs, context, vocabulary, task, replicas)."""
        ...

    def adapter(self, name: str, finishing: bool = False) -> AdapterSpec | None:
        """The LoRA adapter ``name``, if one is loaded; with ``finishing``, also one being unloaded
        (its requests in flight are finishing)."""
        ...

    def adapters(self) -> list[AdapterSpec]:
        """Every loaded adapter, in the order they were loaded (those being unloaded too)."""
        ...

    def is_active(self, model: str) -> bool:
        """Whether a replica of ``model`` (or of an adapter's base) can take requests now."""
        ...

    def generate(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        *,
        req_id: str | None = None,
        timeout_s: float | None = None,
        ttft_slo: float | None = None,
        origin: Origin = DEFAULT_ORIGIN,
    ) -> AsyncIterator[Delta]:
        """``model``'s output for ``prompt``, one Delta per engine step, the last ``finished``;
        leaving the stream early aborts the request."""
        ...
