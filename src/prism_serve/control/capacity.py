"""What the engines on one device can start right now: the "dispatch only what an engine can start
now" rule every queue shares (paper section 6.3: no queuing inside engines).

An engine may start a request if it is ready, has a free sequence slot, and its KV room covers the
prompt's KV plus the per-engine reserve. KV room is the engine's own mapped-but-unused KV plus the
device's free memory (which all engines on the device draw from), capped by its quota if it has one.
The reserve keeps space for the decode tokens of requests already running, so admitted work does
not immediately preempt itself.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping

from prism_serve.control.types import DeviceSnapshot, EngineSnapshot

__all__ = ["DeviceRoom", "Fit"]


class Fit(enum.Enum):
    OK = "ok"
    NOT_READY = "not_ready"  # no engine, or it is still loading
    NO_SLOT = "no_slot"  # max_num_seqs reached
    NO_MEMORY = "no_memory"  # not enough KV room now
    NEVER = "never"  # the prompt's KV exceeds what the engine can ever hold


class _Room:
    __slots__ = ("engine", "max_kv", "private", "quota_room", "ready", "reserve", "slots")

    def __init__(self, e: EngineSnapshot, reserve_tokens: int, final_quotas: bool) -> None:
        self.ready = e.ready
        self.engine = e  # what a prompt's KV takes there (EngineSnapshot.kv_bytes)
        self.private = e.free_kv_bytes
        self.quota_room = None if e.kv_quota_bytes is None else e.kv_quota_bytes - e.used_kv_bytes
        self.slots = math.inf if e.max_num_seqs is None else e.max_num_seqs - e.num_running
        self.reserve = reserve_tokens * e.kv_bytes(1)  # the running requests' next tokens: every layer
        self.max_kv = e.max_kv_bytes
        if final_quotas and e.kv_quota_bytes is not None:  # a slice that never grows: the most it holds
            held = max(0, e.kv_quota_bytes - self.reserve)
            self.max_kv = held if self.max_kv is None else min(self.max_kv, held)


class DeviceRoom:
    """Mutable per-call accounting: each ``take`` consumes what the dispatched request will use.

    ``final_quotas``: the engines' KV quotas never grow (a static partition), so a request whose KV
    and the reserve exceed its engine's quota can never start (``Fit.NEVER``), rather than wait.
    """

    def __init__(
        self,
        device: DeviceSnapshot,
        engines: Mapping[str, EngineSnapshot],
        reserve_tokens: int,
        final_quotas: bool = False,
    ) -> None:
        self.shared = device.free_bytes
        self.shared_blocked = False
        self._rooms = {
            m: _Room(e, reserve_tokens, final_quotas) for m, e in engines.items() if e.device == device.device
        }

    @staticmethod
    def need_bytes(r: _Room, prompt_tokens: int) -> int:
        return r.engine.kv_bytes(prompt_tokens + 1)  # the prompt plus the first generated token

    def _room_bytes(self, r: _Room) -> int:
        room = r.private + (0 if self.shared_blocked else self.shared)
        if r.quota_room is not None:
            room = min(room, r.quota_room)
        return room - r.reserve

    def fit(self, model: str, prompt_tokens: int) -> Fit:
        r = self._rooms.get(model)
        if r is None or not r.ready:
            return Fit.NOT_READY
        need = self.need_bytes(r, prompt_tokens)
        if r.max_kv is not None and need > r.max_kv:
            return Fit.NEVER
        if r.slots <= 0:
            return Fit.NO_SLOT
        return Fit.OK if need <= self._room_bytes(r) else Fit.NO_MEMORY

    def short_of_shared(self, model: str, prompt_tokens: int) -> bool:
        """The request waits for the device's shared memory (not for its own quota)."""
        r = self._rooms.get(model)
        if r is None:
            return False
        need = self.need_bytes(r, prompt_tokens) + r.reserve
        return r.private + self.shared < need and (r.quota_room is None or r.quota_room >= need)

    def can_start_any(self, model: str) -> bool:
        """Whether the engine could start even a one-token prompt."""
        return self.fit(model, 0) is Fit.OK

    def startable(self) -> set[str]:
        return {m for m in self._rooms if self.can_start_any(m)}

    def take(self, model: str, prompt_tokens: int) -> None:
        r = self._rooms[model]
        need = self.need_bytes(r, prompt_tokens)
        from_private = min(need, r.private)
        r.private -= from_private
        self.shared = max(0, self.shared - (need - from_private))
        if r.quota_room is not None:
            r.quota_room -= need
        r.slots -= 1
