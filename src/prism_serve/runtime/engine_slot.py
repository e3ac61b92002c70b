"""What differs between the engines a worker runs: one ``EngineSlot`` per worker.

A worker (runtime/worker.py) is the same process loop for every engine: it opens host cache files,
creates the model's two ledger accounts, times the phases, steps the engine and reports. How a model
becomes an engine on the device, and what the engine keeps between models, is its slot's:

- ``BuiltinSlot`` (builtin_slot.py): prism's engine. Weight pages granted and mapped (spare pages
  first), the host cache copied into them in parallel chunks, the model built over views of them,
  and an elastic KV pool laid out in the reserved KV range;
- ``VllmSlot`` (vllm_slot.py): vLLM's engine, built once per model shape and kept between models,
  with the last model's weights kept as they were.

The worker drives the engine a slot returns only through engine/interface.py's ``WorkerEngine``
and ``WorkerKV``; a third engine is a third slot.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from prism_serve.engine.interface import WorkerEngine, WorkerKV
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.memory.ledger import Account
from prism_serve.runtime import messages as msg

__all__ = ["EngineSlot", "Loaded"]


@dataclass(slots=True)
class Loaded:
    """A model a slot activated: its engine and KV memory, and how it came in (the activation's
    phases, seconds, after the worker opened the host cache file)."""

    engine: WorkerEngine
    kv: WorkerKV
    map_s: float  # weight pages granted and mapped
    copy_s: float  # weights into them
    ready_s: float  # model, KV memory and engine built (vLLM: its engine built, if it had to be)
    copy_bytes: int
    reused_pages: int  # weight pages that were already mapped (spare pages, kept weights)
    created_pages: int  # weight pages created on this activation's path
    load_path: str  # how the weights came in (messages.ActivationPhases.load_path)
    compiled: bool  # the engine runs a compiled graph
    kv_bytes_per_token: int
    weight_pages: int = 0  # weight pages the slot unmaps when the model goes
    # a tensor parallel model's rank and degree (engine/tensor_parallel.py): rank 0's engine is a
    # Leader, the others follow it
    rank: int = 0
    world: int = 1


class EngineSlot(Protocol):
    kind: str  # the engine: "builtin" or "vllm" (messages.ActivateModel.engine_kind)
    needs_tokenizer: bool  # the worker parses the model's tokenizer for it (vLLM tokenizes itself)
    traces_steps: bool  # its steps carry the batch shapes PRISM_STEP_TRACE records

    def build_ahead(self, shape: msg.EngineShape) -> None:
        """A Prepare's engine shape, in idle time (nothing for an engine built per model)."""

    def build_ahead_for(self, m: msg.ActivateModel, shapes: Iterable[msg.EngineShape]) -> None:
        """An activation came before the Prepare's builds (``shapes``, dropped from it) ran: run
        the one for ``m``'s shape first, as it would have run."""

    def built(self) -> list[str]:
        """The engine_keys of the engines it holds built (Prepared.engines)."""

    def activate(
        self,
        m: msg.ActivateModel,
        host: torch.Tensor,
        weight_account: Account,
        kv_account: Account,
        tokenizer: Callable[[str], Tokenizer],
    ) -> Loaded:
        """Serve ``m`` from ``host`` (its host cache file, flat uint8), every byte on the device
        under the two accounts. On failure nothing stays granted or mapped."""

    def release(self, loaded: Loaded, weight_account: Account) -> None:
        """The model goes: its engine aborted, every page it held unmapped or kept as spare."""

    def keep_prefixes(self, loaded: Loaded, path: str, max_bytes: int, fingerprint: str) -> int:
        """Before the model goes: write its engine's hottest cached prefixes, up to ``max_bytes``,
        to a new file at ``path``; the file's size (0: none written, no file)."""

    def restore_prefixes(self, loaded: Loaded, path: str, fingerprint: str) -> int:
        """Right after the activation: read a file ``keep_prefixes`` wrote into the new engine's
        prefix cache; how many blocks it took."""

    def poll(self) -> None:
        """Once per loop turn of the worker."""

    def close(self) -> None: ...
