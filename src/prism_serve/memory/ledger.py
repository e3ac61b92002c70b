"""The device ledger: one memory budget per device, shared by every process that maps pages on it.

A ledger is a small shared-memory file (``/dev/shm/prism-ledger-<namespace>-<device>``) holding the
device budget and one entry per engine: its pid, mapped bytes, optional limit and name. Every
operation takes an exclusive ``flock`` on the file, so a grant is checked and recorded atomically
across processes; ``flock`` is released by the kernel when its holder dies, so a SIGKILL inside an
operation cannot wedge the device. Pages are mapped only after their bytes were granted here
(``Account.try_reserve``), which is what makes double-granting impossible.

Spare pages: a process may keep pages mapped that no model uses (an evicted model's weight pages,
or pages made ahead of time) so that its next activation copies into them instead of creating
pages (``memory/spare.py``). Their bytes stay granted, to an entry registered as ``spare``, since
they are real memory; they are counted as reclaimable (``LedgerSnapshot.spare_bytes``). A grant
refused for lack of budget while spare pages exist asks their holders to give them back
(``reclaim_wanted``): the holders unmap them within a poll interval and the requester retries.
Bytes move between two entries of one process with ``move`` (no moment where both or neither hold
them).

Reclaimable KV: an engine with a prefix cache keeps KV blocks no request holds (engine/prefix_cache.py).
It records in its entry how many of its mapped bytes it would unmap by dropping them
(``Account.set_reclaimable``); those count with spare pages as memory a refused grant may ask
back, and their holders drop cached blocks (least recently used first) when asked.

Entries of dead processes (no such pid, a zombie, or a pid reused by a newer process, told apart by
the start time in ``/proc/<pid>/stat``) are reclaimed by the next operation on the ledger: a crashed
engine's bytes return to the budget without anyone calling ``release``.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import select
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from prism_serve.errors import InvalidRequestError, PrismError

_MAGIC = b"PRISMLG3"
_NUM_SLOTS = 256
_HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("version", "<u4"),
        ("num_slots", "<u4"),
        ("budget", "<i8"),
        ("ops", "<u8"),
        ("reclaim", "<i8"),  # spare bytes a refused grant asked their holders to give back
        ("reclaim_until", "<f8"),  # unix time; the request lapses then
        ("refused_at", "<f8"),  # unix time a grant (reclaim=True) was last refused for lack of budget
    ]
)
_ENTRY = np.dtype(
    [
        ("pid", "<i8"),
        ("start_ticks", "<i8"),  # process start time, to detect a reused pid
        ("mapped", "<i8"),
        ("limit", "<i8"),  # -1: no limit of its own
        ("peak", "<i8"),
        ("registered", "<f8"),  # unix time
        ("spare", "<i8"),  # 1: pages kept mapped for a next activation, reclaimable
        ("reclaimable", "<i8"),  # of "mapped": bytes it gives back when asked (cached KV blocks)
        ("name", "S64"),
    ]
)
_HEADER_BYTES = 64  # header padded so entries are aligned
_FILE_BYTES = _HEADER_BYTES + _NUM_SLOTS * _ENTRY.itemsize
NAMESPACE_ENV = "PRISM_LEDGER_NAMESPACE"
RECLAIM_WINDOW_S = 2.0  # how long a request for spare pages stands unless asked again


class DeviceMemoryExhaustedError(PrismError):
    """The device ledger refused the pages a model's weights (or fixed KV) need: other models hold
    them now."""

    status_code = 503
    error_type = "service_unavailable"


class LedgerError(PrismError):
    """The ledger cannot do what was asked (no such ledger, no free entry, bad slot)."""

    status_code = 500
    error_type = "internal_error"


class LedgerNotFoundError(LedgerError):
    """No ledger exists for the device and no budget was given to create one."""


def ledger_dir() -> Path:
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def default_namespace() -> str:
    """Ledgers are separate per namespace: ``$PRISM_LEDGER_NAMESPACE`` or the user id."""
    return os.environ.get(NAMESPACE_ENV) or f"uid{os.getuid()}"


def ledger_path(device: str, namespace: str | None = None) -> Path:
    ns = namespace or default_namespace()
    for part, what in ((ns, "namespace"), (device, "device")):
        if not re.fullmatch(r"[A-Za-z0-9_.:-]+", part):
            raise InvalidRequestError(f"ledger {what} {part!r} may only hold letters, digits and _.:-")
    return ledger_dir() / f"prism-ledger-{ns}-{device.replace(':', '')}"


def _proc_start_ticks(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot; None if it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may hold spaces and parentheses: fields resume after the last ')'.
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return int(fields[19])


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    slot: int
    pid: int
    name: str
    mapped_bytes: int
    limit_bytes: int | None
    peak_bytes: int
    registered: float
    spare: bool = False
    reclaimable_bytes: int = 0  # of mapped_bytes: cached KV it gives back when a grant needs it


@dataclass(frozen=True, slots=True)
class LedgerSnapshot:
    device: str
    budget_bytes: int
    entries: tuple[LedgerEntry, ...]
    reclaim_bytes: int = 0  # spare bytes asked back now
    reclaim_until: float = 0.0  # unix time the last request lapses: no spare pages are made before
    # unix time a grant was last refused for lack of device budget: memory held for speed alone (a
    # KV pool's lingering pages, memory/kv_pool.py) goes back while this is recent
    refused_at: float = 0.0

    @property
    def used_bytes(self) -> int:
        """Every granted byte, spare pages included (they are physical memory)."""
        return sum(e.mapped_bytes for e in self.entries)

    @property
    def spare_bytes(self) -> int:
        """Granted to spare pages: held now, given back when a grant needs them."""
        return sum(e.mapped_bytes for e in self.entries if e.spare)

    @property
    def cached_bytes(self) -> int:
        """Engines' cached KV that no request holds: held now, given back when a grant needs it."""
        return sum(e.reclaimable_bytes for e in self.entries if not e.spare)

    @property
    def reclaimable_bytes(self) -> int:
        """Spare pages and cached KV: what a refused grant can ask back."""
        return self.spare_bytes + self.cached_bytes

    @property
    def engine_bytes(self) -> int:
        """Granted to engines (weights and KV in use): what a placement cannot count as free."""
        return self.used_bytes - self.reclaimable_bytes

    @property
    def free_bytes(self) -> int:
        return max(0, self.budget_bytes - self.used_bytes)


class DeviceLedger:
    """The budget of one device. Open it in every process that maps memory on the device.

    ``budget_bytes`` creates the ledger if it does not exist (and is ignored if it does; use
    ``set_budget`` to change a live one). Without it, a missing ledger is ``LedgerNotFoundError``.
    """

    def __init__(self, device: str, budget_bytes: int | None = None, namespace: str | None = None) -> None:
        self.device = device
        self.path = ledger_path(device, namespace)
        if budget_bytes is not None and budget_bytes < 0:
            raise InvalidRequestError(f"device budget must be non-negative, got {budget_bytes}")
        flags = os.O_RDWR | (os.O_CREAT if budget_bytes is not None else 0)
        try:
            self._fd = os.open(self.path, flags | os.O_CLOEXEC, 0o600)
        except FileNotFoundError:
            raise LedgerNotFoundError(
                f"no memory ledger for {device} at {self.path}; start an engine on it first or give a budget"
            ) from None
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                if os.fstat(self._fd).st_size == 0:
                    if budget_bytes is None:
                        raise LedgerNotFoundError(f"memory ledger {self.path} is empty")
                    os.ftruncate(self._fd, _FILE_BYTES)
                    self._open_views()
                    self._header["magic"] = _MAGIC
                    self._header["version"] = 3
                    self._header["num_slots"] = _NUM_SLOTS
                    self._header["budget"] = budget_bytes
                else:
                    stale = os.fstat(self._fd).st_size != _FILE_BYTES
                    if not stale:
                        self._open_views()
                        stale = (
                            bytes(self._header["magic"]) != _MAGIC
                            or int(self._header["num_slots"]) != _NUM_SLOTS
                        )
                    if stale:
                        raise LedgerError(
                            f"{self.path} is not a prism memory ledger of this version (one an older "
                            "prism-serve left?): remove it once no prism-serve uses the device, or set "
                            f"{NAMESPACE_ENV}"
                        )
            finally:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
        except BaseException:
            self._views_closed()
            os.close(self._fd)
            raise
        self._own_pid = os.getpid()
        # flock excludes other open files, not threads sharing this one (the pool's prefetch thread).
        self._thread_lock = threading.Lock()
        self._pidfds: dict[tuple[int, int], int] = {}

    def _open_views(self) -> None:
        self._mm = mmap.mmap(self._fd, _FILE_BYTES)
        self._header = np.ndarray((), dtype=_HEADER, buffer=self._mm)
        self._entries = np.ndarray((_NUM_SLOTS,), dtype=_ENTRY, buffer=self._mm, offset=_HEADER_BYTES)

    def _views_closed(self) -> None:
        if hasattr(self, "_mm"):
            del self._header, self._entries
            self._mm.close()
            del self._mm

    # ---- locking and reclaim ----------------------------------------------------------------------

    def __enter__(self) -> DeviceLedger:
        if self._fd < 0:
            raise LedgerError(f"the ledger of {self.device} is closed")
        self._thread_lock.acquire()
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX)
            try:
                self._reclaim_dead()
                self._header["ops"] += 1
            except BaseException:
                fcntl.flock(self._fd, fcntl.LOCK_UN)
                raise
        except BaseException:
            self._thread_lock.release()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread_lock.release()

    def _reclaim_dead(self) -> list[int]:
        reclaimed = []
        seen = set()
        for slot in np.flatnonzero(self._entries["pid"]):
            pid = int(self._entries[slot]["pid"])
            if pid == self._own_pid:
                continue
            key = (pid, int(self._entries[slot]["start_ticks"]))
            seen.add(key)
            if not self._alive(key):
                self._entries[slot] = np.zeros((), dtype=_ENTRY)
                reclaimed.append(int(slot))
        for key in self._pidfds.keys() - seen:
            os.close(self._pidfds.pop(key))
        return reclaimed

    def _alive(self, key: tuple[int, int]) -> bool:
        """Is the process that registered ``key = (pid, start_ticks)`` still running (not a zombie)?

        Reading /proc costs ~20 us; a pidfd, opened once and checked against the start time, turns
        every later check into one poll syscall (readable once the process has exited).
        """
        fd = self._pidfds.get(key)
        if fd is None:
            try:
                fd = os.pidfd_open(key[0])
            except ProcessLookupError:
                return False
            except OSError:  # no pidfd support: read /proc every time
                return _proc_start_ticks(key[0]) == key[1]
            if _proc_start_ticks(key[0]) != key[1]:
                os.close(fd)
                return False
            self._pidfds[key] = fd
        poller = select.poll()  # not select(): a process with 1024 descriptors open may ask too
        poller.register(fd, select.POLLIN)
        return not poller.poll(0)

    def _used(self) -> int:
        return int(self._entries["mapped"].sum())

    def _slot(self, slot: int) -> np.void:
        if not 0 <= slot < _NUM_SLOTS or int(self._entries[slot]["pid"]) == 0:
            raise LedgerError(f"ledger slot {slot} of {self.device} is not registered (reclaimed?)")
        return self._entries[slot]

    # ---- operations -------------------------------------------------------------------------------

    @property
    def budget_bytes(self) -> int:
        return int(self._header["budget"])

    def register(
        self, name: str, limit_bytes: int | None = None, pid: int | None = None, spare: bool = False
    ) -> int:
        """Add an engine (by default this process) and return its slot; ``spare``: an entry for
        pages kept mapped between models (reclaimable)."""
        pid = pid or os.getpid()
        ticks = _proc_start_ticks(pid)
        if ticks is None:
            raise LedgerError(f"process {pid} does not exist")
        if limit_bytes is not None and limit_bytes < 0:
            raise InvalidRequestError(f"limit must be non-negative, got {limit_bytes}")
        with self:
            free = np.flatnonzero(self._entries["pid"] == 0)
            if free.size == 0:
                raise LedgerError(f"the ledger of {self.device} has no free entry ({_NUM_SLOTS} engines)")
            slot = int(free[0])
            e = self._entries[slot]
            e["name"] = name.encode()[:64]
            e["mapped"] = 0
            e["peak"] = 0
            e["limit"] = -1 if limit_bytes is None else limit_bytes
            e["registered"] = time.time()
            e["spare"] = int(spare)
            e["reclaimable"] = 0
            e["start_ticks"] = ticks
            e["pid"] = pid  # last: an entry with a pid is complete
            return slot

    def unregister(self, slot: int) -> int:
        """Remove an engine; returns the bytes it still held (now back in the budget)."""
        with self:
            held = int(self._slot(slot)["mapped"])
            self._entries[slot] = np.zeros((), dtype=_ENTRY)
            return held

    def try_reserve(self, slot: int, num_bytes: int, reclaim: bool = True) -> bool:
        """Grant ``num_bytes`` to ``slot`` if the device budget and its limit allow; never waits.
        Refused for lack of budget while other entries hold spare pages, it asks for them back
        (unless ``reclaim`` is false): a retry a poll interval later may succeed."""
        if num_bytes < 0:
            raise InvalidRequestError(f"cannot reserve {num_bytes} bytes")
        with self:
            e = self._slot(slot)
            mapped = int(e["mapped"]) + num_bytes
            limit = int(e["limit"])
            if 0 <= limit < mapped:
                return False
            short = self._used() + num_bytes - self.budget_bytes
            if short > 0:
                if reclaim:  # a grant made ahead of need (spare pages) asks nobody for anything
                    self._refused(short, exclude=slot)
                return False
            e["mapped"] = mapped
            e["peak"] = max(int(e["peak"]), mapped)
            return True

    def ask_back(self, slot: int, num_bytes: int) -> None:
        """``slot`` needs ``num_bytes`` more than it holds (an allocation the budget refused part of
        the way): ask the holders of spare pages and cached KV for the whole shortfall now. A grant
        refused asks only for its own bytes, so an allocation that maps page by page, retried once a
        step, would otherwise get its memory back a page per step."""
        if num_bytes <= 0:
            return
        with self:
            short = self._used() + num_bytes - self.budget_bytes
            if short > 0:
                self._refused(short, exclude=slot)

    def _refused(self, num_bytes: int, exclude: int) -> None:
        """A grant ``num_bytes`` short of the budget was refused (lock held): note when, and ask
        the entries other than ``exclude`` holding spare pages or cached KV for the shortfall."""
        now = time.time()
        self._header["refused_at"] = now
        spare = self._entries["spare"] != 0
        spare[exclude] = False
        cached = self._entries["reclaimable"].copy()
        cached[spare] = 0  # a spare entry's bytes are counted whole
        cached[exclude] = 0
        held = int(self._entries["mapped"][spare].sum()) + int(cached.sum())
        if held < num_bytes:
            return  # even every spare page would not make room: ask for none
        pending = int(self._header["reclaim"]) if float(self._header["reclaim_until"]) > now else 0
        # the largest shortfall asked for, not their sum: one requester retries the same shortfall
        self._header["reclaim"] = min(held, max(pending, num_bytes))
        self._header["reclaim_until"] = now + RECLAIM_WINDOW_S

    def reclaim_wanted(self) -> int:
        """Spare bytes that refused grants are waiting for now (0: none). Read without the lock:
        holders poll it often, and a stale answer only delays or repeats one round of giving back."""
        if self._fd < 0:
            raise LedgerError(f"the ledger of {self.device} is closed")
        return self._reclaim_pending()

    def _reclaim_pending(self) -> int:
        if float(self._header["reclaim_until"]) <= time.time():
            return 0
        return max(0, int(self._header["reclaim"]))

    def release(self, slot: int, num_bytes: int) -> None:
        with self:
            e = self._slot(slot)
            if not 0 <= num_bytes <= int(e["mapped"]):
                raise LedgerError(
                    f"slot {slot} of {self.device} releases {num_bytes} bytes but holds {int(e['mapped'])}"
                )
            e["mapped"] = int(e["mapped"]) - num_bytes
            given = num_bytes if int(e["spare"]) else min(num_bytes, int(e["reclaimable"]))
            e["reclaimable"] = min(max(0, int(e["reclaimable"]) - given), int(e["mapped"]))
            if given:
                self._header["reclaim"] = max(0, int(self._header["reclaim"]) - given)

    def set_reclaimable(self, slot: int, num_bytes: int) -> None:
        """Record how many of ``slot``'s mapped bytes it would give back when asked (its cached KV)."""
        with self:
            e = self._slot(slot)
            e["reclaimable"] = min(max(0, num_bytes), int(e["mapped"]))

    def move(self, src: int, dst: int, num_bytes: int) -> bool:
        """Move ``num_bytes`` granted to ``src`` over to ``dst`` (pages change owner, not memory);
        both entries must belong to one process. False if ``dst``'s limit does not allow it."""
        with self:
            a, b = self._slot(src), self._slot(dst)
            if int(a["pid"]) != int(b["pid"]):
                raise LedgerError(f"slots {src} and {dst} of {self.device} belong to different processes")
            if not 0 <= num_bytes <= int(a["mapped"]):
                raise LedgerError(
                    f"slot {src} of {self.device} moves {num_bytes} bytes but holds {int(a['mapped'])}"
                )
            mapped = int(b["mapped"]) + num_bytes
            if 0 <= int(b["limit"]) < mapped:
                return False
            a["mapped"] = int(a["mapped"]) - num_bytes
            b["mapped"] = mapped
            b["peak"] = max(int(b["peak"]), mapped)
            return True

    def set_limit(self, slot: int, limit_bytes: int | None) -> None:
        """Cap one engine. A limit below what it holds takes effect as its pages empty."""
        if limit_bytes is not None and limit_bytes < 0:
            raise InvalidRequestError(f"limit must be non-negative, got {limit_bytes}")
        with self:
            self._slot(slot)["limit"] = -1 if limit_bytes is None else limit_bytes

    def set_budget(self, budget_bytes: int) -> None:
        """Change the device budget. Below current use, new grants wait until engines free memory."""
        if budget_bytes < 0:
            raise InvalidRequestError(f"device budget must be non-negative, got {budget_bytes}")
        with self:
            self._header["budget"] = budget_bytes

    def find(self, name: str) -> list[int]:
        """Slots of live engines called ``name``."""
        return [e.slot for e in self.snapshot().entries if e.name == name]

    def entry(self, slot: int) -> LedgerEntry:
        with self:
            return self._entry(slot, self._slot(slot))

    def snapshot(self) -> LedgerSnapshot:
        with self:
            entries = tuple(
                self._entry(int(s), self._entries[s]) for s in np.flatnonzero(self._entries["pid"])
            )
            return self._snapshot_of(self.budget_bytes, entries)

    def peek(self) -> LedgerSnapshot:
        """``snapshot()`` without the file lock, for a reader that must never wait on another
        process: the controller's event loop builds one per policy call, and a worker holding the
        lock while the OS runs its busy neighbours (an engine's OpenMP threads on every core) made
        it wait tens of milliseconds, every stream's tokens with it. Entries of processes that died
        are left out rather than reclaimed (the next locked operation reclaims them). Every field is
        an aligned word read whole, but entries may be read moments apart: a view to decide from,
        which every grant checks again under the lock, never one to grant from."""
        with self._thread_lock:  # the pidfd cache is this process's own
            if self._fd < 0:
                raise LedgerError(f"the ledger of {self.device} is closed")
            raw = self._entries.copy()
            budget = int(self._header["budget"])
            live = [
                int(s)
                for s in np.flatnonzero(raw["pid"])
                if int(raw[s]["pid"]) == self._own_pid
                or self._alive((int(raw[s]["pid"]), int(raw[s]["start_ticks"])))
            ]
            return self._snapshot_of(budget, tuple(self._entry(s, raw[s]) for s in live))

    def _snapshot_of(self, budget: int, entries: tuple[LedgerEntry, ...]) -> LedgerSnapshot:
        """A snapshot of ``entries`` with the header's reclaim and refusal fields as they are now."""
        return LedgerSnapshot(
            self.device, budget, entries, self._reclaim_pending(),
            float(self._header["reclaim_until"]), float(self._header["refused_at"]),
        )  # fmt: skip

    @staticmethod
    def _entry(slot: int, e: np.void) -> LedgerEntry:
        limit = int(e["limit"])
        return LedgerEntry(
            slot=slot,
            pid=int(e["pid"]),
            name=bytes(e["name"]).decode(errors="replace"),
            mapped_bytes=int(e["mapped"]),
            limit_bytes=None if limit < 0 else limit,
            peak_bytes=int(e["peak"]),
            registered=float(e["registered"]),
            spare=bool(int(e["spare"])),
            reclaimable_bytes=int(e["reclaimable"]),
        )

    def account(self, name: str, limit_bytes: int | None = None, spare: bool = False) -> Account:
        """Register this process as engine ``name`` and return its handle."""
        return Account(self, self.register(name, limit_bytes, spare=spare))

    def close(self) -> None:
        if self._fd >= 0:
            for fd in self._pidfds.values():
                os.close(fd)
            self._pidfds.clear()
            self._views_closed()
            os.close(self._fd)
            self._fd = -1

    def unlink(self) -> None:
        """Delete the ledger file (tests, and a controller leaving a ledger nobody else uses)."""
        self.path.unlink(missing_ok=True)

    @staticmethod
    def list_devices(namespace: str | None = None) -> list[str]:
        """Devices that have a ledger in ``namespace``."""
        prefix = f"prism-ledger-{namespace or default_namespace()}-"
        out = []
        for p in sorted(ledger_dir().glob(prefix + "*")):
            dev = p.name[len(prefix) :]
            m = re.fullmatch(r"([a-z]+)(\d*)", dev)
            out.append(f"{m.group(1)}:{m.group(2)}" if m and m.group(2) else dev)
        return out


class Account:
    """One engine's entry in a device ledger: grant and release bytes under the shared budget."""

    def __init__(self, ledger: DeviceLedger, slot: int) -> None:
        self.ledger = ledger
        self.slot = slot
        self._closed = False
        # False: this account's grants never ask other entries for their spare pages (memory
        # taken ahead of need, such as a vLLM engine built in a worker's idle time)
        self.reclaim = True

    def try_reserve(self, num_bytes: int, reclaim: bool | None = None) -> bool:
        return self.ledger.try_reserve(self.slot, num_bytes, self.reclaim if reclaim is None else reclaim)

    def ask_back(self, num_bytes: int) -> None:
        """This account wants ``num_bytes`` more (``DeviceLedger.ask_back``); nothing for an account
        that asks no one for spare pages."""
        if self.reclaim:
            self.ledger.ask_back(self.slot, num_bytes)

    def move_to(self, other: Account, num_bytes: int) -> bool:
        return self.ledger.move(self.slot, other.slot, num_bytes)

    def release(self, num_bytes: int) -> None:
        self.ledger.release(self.slot, num_bytes)

    def entry(self) -> LedgerEntry:
        return self.ledger.entry(self.slot)

    def set_limit(self, limit_bytes: int | None) -> None:
        self.ledger.set_limit(self.slot, limit_bytes)

    def set_reclaimable(self, num_bytes: int) -> None:
        self.ledger.set_reclaimable(self.slot, num_bytes)

    def close(self) -> None:
        """Leave the ledger; any bytes still recorded go back to the budget."""
        if not self._closed:
            self._closed = True
            with contextlib.suppress(LedgerError):  # already reclaimed
                self.ledger.unregister(self.slot)
