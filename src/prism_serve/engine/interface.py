"""What a worker drives: one engine serving one model, and the KV memory behind it.

Two engines implement ``WorkerEngine``: the built-in ``LLMEngine`` (llm_engine.py) and vLLM's engine
behind ``VllmEngine`` (vllm_engine.py, ``engine: vllm`` models). Their KV memory implements
``WorkerKV``: memory/'s ``ElasticKVPool`` for the built-in engine, runtime/vllm_slot.py's
``VllmMemory`` for vLLM's. runtime/worker.py uses nothing else of either, so a third engine is a
class with these members and a way to build it from an ``ActivateModel``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.sequence import RequestOutput

if TYPE_CHECKING:
    from prism_serve.engine.lora import LoraAdapter
    from prism_serve.engine.models.config import ArchConfig

__all__ = ["RequestCounts", "WorkerEngine", "WorkerKV"]


class WorkerEngine(Protocol):
    config: Any  # EngineConfig: max_num_seqs, dtype, ... as the engine was built with
    max_model_len: int
    stalled: bool  # the ledger refused KV memory a waiting request needs: poll again soon
    last_step_seqs: int  # requests in the last step, and the tokens it fed (statistics)
    last_step_tokens: int
    # its LoRA adapters (``.adapters``: the registered ones by name); None where it serves none
    adapters: Any

    def register_adapter(self, name: str, path: str, load: Callable[[ArchConfig, int], LoraAdapter]) -> None:
        """Register LoRA adapter ``name`` (PEFT directory ``path``); ``load(config, max_rank)`` gives
        its checked weights where the engine takes them from the caller (the built-in engine: views
        of the host cache), while vLLM reads the directory itself."""

    def remove_lora(self, name: str, force: bool = False) -> list[str]:
        """Forget adapter ``name``; with ``force`` its requests are aborted (their ids returned)."""

    def add_request(
        self, prompt_token_ids: list[int], params: SamplingParams, req_id: str, adapter: str | None = None
    ) -> None:
        """Queue a request (with LoRA ``adapter``, a registered one); a bad one raises a PrismError
        (InvalidRequestError and its kind)."""

    def step(self) -> list[RequestOutput]:
        """One scheduling step: what each request produced since the last one."""

    def abort_request(self, req_id: str) -> bool: ...

    def abort_all(self) -> list[str]: ...

    def has_unfinished_requests(self) -> bool: ...

    def unfinished_request_ids(self) -> list[str]: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    @property
    def num_cached_blocks(self) -> int:
        """KV blocks its prefix cache keeps that no request holds (reclaimable; 0 without one)."""

    def cached_blocks(self) -> list[int]:
        """Those blocks' ids, least recently used first."""

    def drop_cached(self, num_blocks: int | None = None) -> int:
        """Give up to ``num_blocks`` (None: all) of them back to its KV memory; returns how many."""

    def close(self) -> None: ...


class WorkerKV(Protocol):
    """An engine's KV memory as the worker reports and steers it; every byte is in the ledger."""

    @property
    def block_bytes(self) -> int: ...

    @property
    def num_total_blocks(self) -> int: ...

    @property
    def num_used_blocks(self) -> int: ...

    @property
    def held_bytes(self) -> int:
        """What it holds in its device's ledger now (the worker reports it as the model's KV):
        the pages it has mapped, or a fixed pool's whole grant, mapped yet or not."""

    def shrink_buffer(self) -> int:
        """The engine is idle: give back what it keeps mapped ahead; returns the bytes."""

    def set_limit(self, limit_bytes: int | None) -> None: ...

    def close(self) -> None:
        """The model leaves: unmap and release everything."""


class RequestCounts:
    """The request counts both engines give the same way, from their ``_requests`` (the requests in
    flight, by id, each with its ``adapter``) and their ``scheduler``'s ``running`` and ``waiting``
    queues; and the requests of an adapter about to be removed."""

    _requests: dict
    scheduler: Any
    adapters: Any

    def _end_adapter_requests(self, name: str, force: bool) -> list[str]:
        """Before adapter ``name`` is removed: InvalidAdapterError if it is not registered,
        AdapterInUseError if requests use it, unless ``force``: then they are aborted (their ids)."""
        from prism_serve.engine.lora import AdapterInUseError, InvalidAdapterError

        if self.adapters is None or name not in self.adapters.adapters:
            raise InvalidAdapterError(f"adapter {name!r} is not registered")
        users = [r for r, q in self._requests.items() if q.adapter == name]
        if users and not force:
            raise AdapterInUseError(f"adapter {name!r} has {len(users)} requests in flight")
        for r in users:
            self.abort_request(r)  # type: ignore[attr-defined]
        return users

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._requests)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)
