"""Typed snapshots in, typed actions out, and the control plane's named errors.

Everything here is an immutable value. The runtime and the simulator build snapshots from their own
state, call a policy, and apply the returned actions in order. Units: bytes for memory, seconds for
time (``now`` and every SLO), requests per second for rates.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from prism_serve.errors import DuplicateRequestError, PrismError

__all__ = [
    "DEFAULT_TPOT_SLO_S",
    "DEFAULT_TTFT_SLO_S",
    "PLACEMENT_COALESCE_S",
    "PREFIX_BLOCK_TOKENS",
    "REPLICA_SEPARATOR",
    "Action",
    "Activate",
    "ClusterSnapshot",
    "ControlError",
    "Defer",
    "DeviceSnapshot",
    "Dispatch",
    "DuplicateRequestError",
    "EngineSnapshot",
    "Enqueue",
    "Evict",
    "InvalidKnobError",
    "InvalidSnapshotError",
    "Migrate",
    "ModelProfile",
    "ModelSnapshot",
    "ModelState",
    "Origin",
    "Priority",
    "Reject",
    "RejectReason",
    "Request",
    "SetKVQuota",
    "UnknownPolicyError",
    "replica_name",
    "split_kv_bytes",
]


# ---------------------------------------------------------------------------------------------------
# Errors. The control plane is called with data the runtime built, so a bad snapshot is a bug on the
# caller's side (500), while a bad policy name or knob is a configuration error found at start-up.


class ControlError(PrismError):
    """Base class of the control plane's errors."""


class InvalidSnapshotError(ControlError, ValueError):
    """A snapshot, request or queue operation is inconsistent (negative bytes, unknown device, ...)."""


class UnknownPolicyError(ControlError, ValueError):
    """No policy is registered under this name."""


class InvalidKnobError(ControlError, ValueError):
    """A policy knob is unknown or out of range."""


def _finite_nonneg(x: float) -> bool:
    return math.isfinite(x) and x >= 0


# ---------------------------------------------------------------------------------------------------
# Snapshots


class ModelState(enum.Enum):
    EVICTED = "evicted"  # weights in host memory only; no engine
    ACTIVATING = "activating"  # an Activate or Migrate is being applied; placement is the target
    ACTIVE = "active"  # weights mapped on every device of `placement`, engine serving


@dataclass(slots=True, frozen=True)
class ModelProfile:
    """Nominal per-request costs of a model, from the cost model or the runtime's measurements.

    The throughput estimate of the ``muxserve`` baseline and the compute demand that prism's
    placement balances (:attr:`ModelSnapshot.busy`) read these; admission uses the per-device
    prefill speed each engine reports.
    """

    mean_prompt_tokens: float = 512.0
    mean_output_tokens: float = 256.0
    prefill_tokens_per_s: float = 8000.0
    decode_step_s: float = 0.025  # one decode iteration of one request at a typical batch size
    # measured engine-busy seconds per request served (step time over requests, batching included);
    # None: not measured yet, so the busy fraction comes from the token means and speeds above
    busy_s_per_request: float | None = None
    # requests/s one replica serves on its own device within the model's SLOs (the simulator: from
    # the cost model; live: requests per second of engine stepping, measured). None: unknown, so
    # prism never gives the model a second replica
    max_rate: float | None = None

    def __post_init__(self) -> None:
        if not (self.mean_prompt_tokens > 0 and self.mean_output_tokens > 0):
            raise InvalidSnapshotError(f"bad token means in {self}")
        if not (self.prefill_tokens_per_s > 0 and self.decode_step_s > 0):
            raise InvalidSnapshotError(f"bad speeds in {self}")
        if not (self.busy_s_per_request is None or _finite_nonneg(self.busy_s_per_request)):
            raise InvalidSnapshotError(f"bad busy_s_per_request in {self}")
        if not (self.max_rate is None or self.max_rate > 0):
            raise InvalidSnapshotError(f"bad max_rate in {self}")

    @property
    def service_s(self) -> float:
        """One request alone on the engine: its prefill plus one decode step per output token."""
        return (
            self.mean_prompt_tokens / self.prefill_tokens_per_s + self.mean_output_tokens * self.decode_step_s
        )


@dataclass(slots=True, frozen=True)
class ModelSnapshot:
    """One model as the control plane sees it.

    ``weight_bytes`` and ``kv_bytes_per_token`` are for the whole model; a tensor-parallel model puts
    ``1/tp_size`` of each on every device of ``placement`` (rank order).
    """

    model: str
    rate: float  # requests/s over the forecast window (control.forecast)
    ttft_slo: float  # s
    tpot_slo: float  # s
    weight_bytes: int
    kv_bytes_per_token: int
    tp_size: int = 1
    placement: tuple[str, ...] = ()
    state: ModelState = ModelState.EVICTED
    last_request_time: float | None = None  # None: never received a request
    num_queued: int = 0  # waiting in a device queue or deferred by the runtime
    num_running: int = 0  # dispatched to an engine and not finished
    pinned: bool = False  # never evicted (it may still migrate)
    profile: ModelProfile = field(default_factory=ModelProfile)
    # when its current placement was decided (activation or migration started, caller's clock);
    # None: unknown, so prism's migration_cooldown_s does not hold it in place
    placed_at: float | None = None
    # how many seconds the rate estimator had been watching the model (since the control loop
    # started, or since its first arrival) when that placement was decided (near 0: a placement
    # made blind, as at start-up or on a warm-up; None: unknown): prism holds a busy model's
    # placement no longer than the history it was decided on
    placed_history_s: float | None = None
    # forecast arrivals/s over the current forecast window (control.forecast.SeasonalForecaster);
    # None: no complete window yet (nothing known: prism prewarms such models into free memory)
    forecast_rate: float | None = None
    # resident, activated while no request of it was waiting, and none has arrived since
    # (control.loop decides it): its memory is the first to yield to real demand
    prewarmed: bool = False
    # a replica slot of the served model named here (its own engine on other devices, the same host
    # weights; see replica_name); None: the served model itself, which is also its replica 0
    replica_of: str | None = None
    # the model's own keep-alive (YAML keep_alive): idle this long, it is evicted whatever the
    # policy and the memory pressure; negative: never evicted for being idle; None: the policy decides
    keep_alive_s: float | None = None
    # requests/s the model is expected to get (its config's expected_rate, which ``prism plan``
    # writes): ``rate`` counts it for the part of the rate window not yet watched; None: none given,
    # so a rate right after start-up is only its first arrivals
    expected_rate: float | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidSnapshotError("model name must not be empty")
        nan_keep_alive = self.keep_alive_s is not None and math.isnan(self.keep_alive_s)
        if nan_keep_alive:
            raise InvalidSnapshotError(f"{self.model}: keep_alive_s must not be NaN")
        if not _finite_nonneg(self.rate):
            raise InvalidSnapshotError(f"{self.model}: rate must be finite and >= 0, got {self.rate}")
        if not (self.ttft_slo > 0 and math.isfinite(self.ttft_slo)):
            raise InvalidSnapshotError(f"{self.model}: ttft_slo must be > 0")
        if not (self.tpot_slo > 0 and math.isfinite(self.tpot_slo)):
            raise InvalidSnapshotError(f"{self.model}: tpot_slo must be > 0")
        if not (self.weight_bytes >= 0 and self.kv_bytes_per_token > 0):
            raise InvalidSnapshotError(f"{self.model}: bad byte sizes")
        if not self.tp_size >= 1:
            raise InvalidSnapshotError(f"{self.model}: tp_size must be >= 1, got {self.tp_size}")
        if not (self.num_queued >= 0 and self.num_running >= 0):
            raise InvalidSnapshotError(f"{self.model}: negative request counts")
        if not (self.placed_at is None or math.isfinite(self.placed_at)):
            raise InvalidSnapshotError(f"{self.model}: placed_at must be finite")
        if not (self.placed_history_s is None or _finite_nonneg(self.placed_history_s)):
            raise InvalidSnapshotError(f"{self.model}: placed_history_s must be finite and >= 0")
        if not (self.forecast_rate is None or _finite_nonneg(self.forecast_rate)):
            raise InvalidSnapshotError(f"{self.model}: forecast_rate must be finite and >= 0")
        if not (self.expected_rate is None or _finite_nonneg(self.expected_rate)):
            raise InvalidSnapshotError(f"{self.model}: expected_rate must be finite and >= 0")
        if self.replica_of is not None:
            prefix, _, index = self.model.rpartition(REPLICA_SEPARATOR)
            if not (prefix == self.replica_of and index.isdigit() and int(index) > 0):
                raise InvalidSnapshotError(
                    f"{self.model}: replica slots of {self.replica_of!r} are named "
                    f"{self.replica_of}#k, k >= 1"
                )
        if self.state is ModelState.EVICTED:
            if self.placement:
                raise InvalidSnapshotError(f"{self.model}: an evicted model has no placement")
        else:
            if not (len(self.placement) == self.tp_size and len(set(self.placement)) == self.tp_size):
                raise InvalidSnapshotError(
                    f"{self.model}: placement {self.placement} must name {self.tp_size} distinct devices"
                )

    @property
    def group(self) -> str:
        """The served model this snapshot is a replica of (its own name for replica 0)."""
        return self.replica_of or self.model

    @property
    def resident(self) -> bool:
        """Weights are (or are being) mapped on devices."""
        return self.state is not ModelState.EVICTED

    @property
    def demand(self) -> float:
        """SLO-weighted request rate r/s of the whole model: the numerator of KVPR (paper section 6.2)."""
        return self.rate / self.ttft_slo

    @property
    def busy(self) -> float:
        """Predicted fraction of time the model's engine has work, in [0, 1]: its compute demand on
        each device it is placed on (every TP rank steps whenever the model does).

        Measured (``profile.busy_s_per_request``): rate x busy seconds per request. Otherwise the
        engine is taken as an M/G/inf system with the profile's service time, so it is busy with
        probability ``1 - exp(-rate * service_s)`` (overlapping requests share steps by batching).
        """
        if self.rate <= 0:
            return 0.0
        measured = self.profile.busy_s_per_request
        if measured is not None:
            return min(1.0, self.rate * measured)
        return -math.expm1(-self.rate * self.profile.service_s)

    @property
    def part_weight_bytes(self) -> int:
        """Weight bytes one TP rank maps on its device (rounded up so parts never undercount)."""
        return -(-self.weight_bytes // self.tp_size)

    @property
    def part_kv_bytes_per_token(self) -> int:
        return -(-self.kv_bytes_per_token // self.tp_size)

    def idle_for(self, now: float) -> float:
        """Seconds without queued or running work since the last request (inf if it never had one)."""
        if self.num_queued or self.num_running:
            return 0.0
        if self.last_request_time is None:
            return math.inf
        return max(0.0, now - self.last_request_time)


@dataclass(slots=True, frozen=True)
class DeviceSnapshot:
    """One accelerator (or CPU memory domain) and what is mapped on it."""

    device: str
    capacity_bytes: int  # memory models may use: weights plus KV
    mapped_bytes: int = 0  # physically mapped now (weights and KV of every engine on it)
    models: tuple[str, ...] = ()  # models with a TP rank placed here
    num_queued: int = 0  # requests in this device's queue (qlm routes by it)
    queued_models: tuple[str, ...] = ()  # models with requests in this device's queue

    def __post_init__(self) -> None:
        if not self.device:
            raise InvalidSnapshotError("device name must not be empty")
        if not self.capacity_bytes > 0:
            raise InvalidSnapshotError(f"{self.device}: capacity_bytes must be > 0")
        if not (self.mapped_bytes >= 0 and self.num_queued >= 0):
            raise InvalidSnapshotError(f"{self.device}: negative counts")
        if len(set(self.models)) != len(self.models):
            raise InvalidSnapshotError(f"{self.device}: duplicate models {self.models}")

    @property
    def free_bytes(self) -> int:
        return max(0, self.capacity_bytes - self.mapped_bytes)


def split_kv_bytes(split: tuple[int, tuple[int, int] | None], tokens: float) -> float:
    """KV bytes a request of ``tokens`` tokens holds at most in an engine whose KV grows by
    ``split``: (bytes per token of its full-context layers, (tokens its windowed layers hold at
    most, their bytes per token) or None), as engine/kv_cache.py's ``KVGroups.kv_split`` gives it."""
    per_token, window = split
    return tokens * per_token + (0 if window is None else min(tokens, window[0]) * window[1])


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """The engine serving ``model`` on ``device`` (its rank-0 device for a TP model).

    KV figures are for this device only. ``free_kv_bytes`` is KV already mapped to the engine and
    unused; the engine may also map pages from the device's free memory, which every engine on the
    device shares.
    """

    model: str
    device: str
    # on this device (one TP rank); with ``kv_window``, its full-context layers'; 0: an encoder, which
    # keeps no KV (each input is read whole and pooled)
    kv_bytes_per_token: int
    ready: bool = True  # weights loaded and accepting requests
    free_kv_bytes: int = 0
    used_kv_bytes: int = 0
    kv_quota_bytes: int | None = None  # per-engine cap set by SetKVQuota; None: no cap
    max_kv_bytes: int | None = None  # most KV the engine could ever hold; None: unknown
    num_running: int = 0
    max_num_seqs: int | None = None
    prefill_tokens_per_s: float | None = None  # measured or from the cost model
    # of num_running, those the engine holds but has not started yet (its waiting queue): the
    # prefill backlog a new request of this engine queues behind
    num_waiting: int = 0
    # an engine whose sliding-window layers free what their window has passed (engine/kv_cache.py
    # KVGroups): (tokens, bytes per token) of those layers, which hold a request's last ``tokens``
    # tokens at most; None: every layer holds every token (kv_bytes_per_token is all of them)
    kv_window: tuple[int, int] | None = None

    def kv_bytes(self, tokens: int) -> int:
        """KV bytes a request of ``tokens`` tokens holds at most in this engine."""
        return split_kv_bytes((self.kv_bytes_per_token, self.kv_window), tokens)

    def __post_init__(self) -> None:
        if not self.kv_bytes_per_token >= 0:
            raise InvalidSnapshotError(f"{self.model}@{self.device}: kv_bytes_per_token must be >= 0")
        if self.kv_window is not None and not (self.kv_window[0] > 0 and self.kv_window[1] > 0):
            raise InvalidSnapshotError(f"{self.model}@{self.device}: kv_window must be positive")
        if not (self.free_kv_bytes >= 0 and self.used_kv_bytes >= 0 and self.num_running >= 0):
            raise InvalidSnapshotError(f"{self.model}@{self.device}: negative KV or request counts")
        if not 0 <= self.num_waiting <= self.num_running:
            raise InvalidSnapshotError(f"{self.model}@{self.device}: num_waiting must be in [0, num_running]")
        if not (self.prefill_tokens_per_s is None or self.prefill_tokens_per_s > 0):
            raise InvalidSnapshotError(f"{self.model}@{self.device}: prefill_tokens_per_s must be > 0")


@dataclass(slots=True, frozen=True)
class ClusterSnapshot:
    """Every model, device and engine at one instant. Build it with :meth:`build`.

    Devices keep their given order; it is the tie-break wherever two devices are equally good, so
    the runtime and the simulator see identical decisions for identical snapshots.
    """

    models: Mapping[str, ModelSnapshot]
    devices: Mapping[str, DeviceSnapshot]
    engines: Mapping[str, EngineSnapshot] = field(default_factory=dict)  # by model
    # served model -> its replica slots beyond replica 0, in the order the snapshot lists them (the
    # bodies list them in slot order; routing breaks ties by this order), built from replica_of
    extra_replicas: Mapping[str, tuple[str, ...]] = field(init=False, default_factory=dict)
    # models with requests waiting and no copy resident or activating (deferred for room, or waiting
    # for the tick), by name
    starved: tuple[str, ...] = field(init=False, default=())
    # values derived from this snapshot alone that a policy reads many times in one call (a served
    # model's resident replicas, a device's summed busy fraction: control/replicas.py), each kept
    # here on first use by the function that derives it, under its own key: a cache of pure
    # functions of the snapshot, never handed on to another snapshot, so it never goes stale and
    # no reader can tell it from computing afresh. What a policy carries from one call to the next
    # is the control loop's (policies/base.py, PolicyMemo), never the snapshot's.
    derived: dict = field(init=False, default_factory=dict, repr=False, compare=False)
    # derived values the snapshots before this one computed, shared along the chain of snapshots a
    # body builds with ``updated`` (a snapshot from ``build`` starts an empty one). An entry is used
    # only after checking that its inputs are the very entries of this snapshot (the same immutable
    # objects: control/replicas.py's replica groups) or equal to them (static partitioning's last
    # packing, with the knobs it was made with), so it is what computing afresh would give; a stale
    # one is recomputed and replaced. Nothing a policy carries from one decision to the next is kept
    # here: only what it would compute again from this snapshot.
    carried: dict = field(init=False, default_factory=dict, repr=False, compare=False)

    @classmethod
    def build(
        cls,
        models: Iterable[ModelSnapshot],
        devices: Iterable[DeviceSnapshot],
        engines: Iterable[EngineSnapshot] = (),
    ) -> ClusterSnapshot:
        return cls(_index(models, "model"), _index(devices, "device"), _index(engines, "model"))

    def __post_init__(self) -> None:
        # Frozen views: a policy must not be able to edit the caller's state through a snapshot.
        models = dict(self.models)
        devices = dict(self.devices)
        engines = dict(self.engines)
        object.__setattr__(self, "models", MappingProxyType(models))
        object.__setattr__(self, "devices", MappingProxyType(devices))
        object.__setattr__(self, "engines", MappingProxyType(engines))
        # The layout is checked in one pass over the models (a body may build many snapshots, see
        # ``updated``); messages are formatted only on failure.
        on_device: dict[str, list[str]] = {d: [] for d in devices}
        extra: dict[str, list[str]] = {}
        for m in models.values():
            for d in m.placement:
                placed = on_device.get(d)
                if placed is None:
                    raise InvalidSnapshotError(f"{m.model}: placement names unknown device {d!r}")
                placed.append(m.model)
            if m.replica_of is not None:
                base = models.get(m.replica_of)
                if base is None or base.replica_of is not None:
                    raise InvalidSnapshotError(
                        f"{m.model}: replica of {m.replica_of!r}, which is not a served model here"
                    )
                extra.setdefault(m.replica_of, []).append(m.model)
        for d, dev in devices.items():
            # a device's models have no duplicates (DeviceSnapshot) nor do its placed ones (names
            # are unique, a model's devices distinct): equal lengths and containment mean equal sets
            placed = on_device[d]
            if len(placed) != len(dev.models) or not set(dev.models).issuperset(placed):
                raise InvalidSnapshotError(
                    f"{d}: device lists models {sorted(dev.models)} but placements put {sorted(placed)}"
                )
        for name, e in engines.items():
            m = models.get(name)
            if not _engine_fits(e, m):
                if m is None or m.state is ModelState.EVICTED:
                    raise InvalidSnapshotError(f"engine for {name!r}: no such resident model")
                raise InvalidSnapshotError(f"engine for {name!r} must be on {m.placement[0]}")
        object.__setattr__(
            self,
            "extra_replicas",
            MappingProxyType({k: tuple(v) for k, v in extra.items()}),
        )
        object.__setattr__(self, "starved", self._starved())

    def _starved(self) -> tuple[str, ...]:
        """The models with requests waiting and no copy resident: evicted with a queue, and no
        resident replica of their served model (a replica slot's requests go to one when there is)."""
        models = self.models
        return tuple(
            m.model
            for m in models.values()
            if m.num_queued
            and m.state is ModelState.EVICTED
            and not any(models[r].resident for r in self.replicas(m.group))
        )

    def updated(
        self,
        models: Iterable[ModelSnapshot] = (),
        devices: Iterable[DeviceSnapshot] = (),
        engines: Iterable[EngineSnapshot] = (),
        gone_engines: Iterable[str] = (),
    ) -> ClusterSnapshot:
        """This snapshot with the given entries replaced or added (by name) and ``gone_engines``
        removed: the snapshot a fresh build of the result would be, validated as strictly, in time
        proportional to the change when the layout (placements, residency, replica links, each
        device's model list) is unchanged, because then every cross-check a build makes still
        holds. Anything else is rebuilt from scratch. For a body that rebuilds its snapshot often
        and changes a few entries in between (the simulator, once or twice per arrival)."""
        models = list(models)
        engines = list(engines)
        new_models, same, queued_evicted = self._with_models(models)
        # copy() of a MappingProxyType copies the dict under it, many times faster than dict(proxy)
        new_devices, new_engines = self.devices.copy(), self.engines.copy()
        moved: list[str] = []  # devices whose model list changed
        added = False
        for d in devices:
            old = new_devices.get(d.device)
            new_devices[d.device] = d
            if old is None:
                added = True
            elif old.models != d.models:
                moved.append(d.device)
        same = same and not (added or moved)
        for name in gone_engines:
            if new_engines.pop(name, None) is None:
                raise InvalidSnapshotError(f"engine for {name!r} to drop is not in the snapshot")
        for e in engines:
            new_engines[e.model] = e
            m = new_models.get(e.model)
            same = same and _engine_fits(e, m)
        if same:
            return self._successor(
                new_models, MappingProxyType(new_devices), MappingProxyType(new_engines), queued_evicted
            )
        if not added:
            snap = self._relaid(models, engines, new_models, new_devices, new_engines, moved)
            if snap is not None:
                return snap
        snap = ClusterSnapshot(new_models, new_devices, new_engines)  # checked whole: it says what is wrong
        object.__setattr__(snap, "carried", self.carried)
        return snap

    def _relaid(
        self,
        models: list[ModelSnapshot],
        engines: list[EngineSnapshot],
        new_models: dict[str, ModelSnapshot],
        new_devices: dict[str, DeviceSnapshot],
        new_engines: dict[str, EngineSnapshot],
        moved: list[str],
    ) -> ClusterSnapshot | None:
        """``updated``'s snapshot when its change moves the layout (a placement, a residency, a
        device's model list) of models already here: only the devices and engines the change
        touches are checked again, each as a fresh build would (the rest held in this snapshot and
        did not change). None when a fresh build must decide: a model added or relinked as a
        replica, or any check failing (the build then names what is wrong)."""
        old_models = self.models
        if len(new_models) != len(old_models):
            return None  # a model added
        changed = {m.model: new_models[m.model] for m in models}
        touched = set(moved)
        for name, m in changed.items():
            old = old_models[name]
            if old.replica_of != m.replica_of:
                return None
            touched.update(old.placement)
            touched.update(m.placement)
        for d in touched:
            dev = new_devices.get(d)
            if dev is None:
                return None
            # what the placements put there now: the models it had that did not change, and the
            # changed ones placed there
            placed = [n for n in self.devices[d].models if n not in changed]
            placed += [n for n, m in changed.items() if d in m.placement]
            if len(placed) != len(dev.models) or not set(dev.models).issuperset(placed):
                return None
        for name, m in changed.items():
            e = new_engines.get(name)
            if e is not None and not _engine_fits(e, m):
                return None
        for e in engines:
            if not _engine_fits(e, new_models.get(e.model)):
                return None
        return self._successor(new_models, MappingProxyType(new_devices), MappingProxyType(new_engines), True)

    def deferring(
        self,
        models: Iterable[ModelSnapshot],
        resolve: Callable[
            [ClusterSnapshot], tuple[Mapping[str, DeviceSnapshot], Mapping[str, EngineSnapshot]]
        ],
        entry: Callable[[ClusterSnapshot, str, str], tuple[object | None, object | None]],
    ) -> ClusterSnapshot | None:
        """This snapshot with ``models`` replaced or added (by name), as :meth:`updated`, whose
        devices and engines are built only when read; None when the models change the layout (a
        placement, residency or replica link), which every device's and engine's entry must be
        checked against at once. For a body whose policy calls mostly read models alone or a few
        devices (the simulator at an arrival). A read of one entry asks ``entry(snapshot, kind,
        name)`` ("devices" or "engines") for it as (the entry now or None, the entry as the body
        last built it or None); any other read asks ``resolve(snapshot)`` for both mappings whole,
        final and checked (a body builds them with :meth:`updated`), and so does an entry that
        changed its layout (a device's model list, an engine's device). The body must give them as
        they were at this instant: no reader may ask after the state they show changed."""
        new_models, same, queued_evicted = self._with_models(models)
        if not same:
            return None
        deferred = _Deferred(resolve, entry)
        snap = self._successor(
            new_models,
            _DeferredEntries(deferred, "devices"),
            _DeferredEntries(deferred, "engines"),
            queued_evicted,
        )
        deferred.owner = snap
        return snap

    def _with_models(self, models: Iterable[ModelSnapshot]) -> tuple[dict[str, ModelSnapshot], bool, bool]:
        """This snapshot's models with ``models`` replaced or added, whether the layout is the same,
        and whether an evicted model's queue changed (``starved`` may change)."""
        new_models = self.models.copy()
        same = True
        queued_evicted = False
        for m in models:
            old = new_models.get(m.model)
            new_models[m.model] = m
            evicted = m.state is ModelState.EVICTED
            if (
                old is None
                or old.placement != m.placement
                or old.replica_of != m.replica_of
                or (old.state is ModelState.EVICTED) is not evicted
            ):
                same = False
            elif evicted and old.num_queued != m.num_queued:
                queued_evicted = True
        return new_models, same, queued_evicted

    def _successor(
        self, models: dict[str, ModelSnapshot], devices: Mapping, engines: Mapping, queued_evicted: bool
    ) -> ClusterSnapshot:
        """A snapshot of ``models``, ``devices`` and ``engines`` in this snapshot's layout (already
        checked): its replica links, and its starved models unless an evicted model's queue changed."""
        snap = object.__new__(ClusterSnapshot)
        for name, value in (
            ("models", MappingProxyType(models)),
            ("devices", devices),
            ("engines", engines),
            ("extra_replicas", self.extra_replicas),
            ("starved", self.starved),
            ("derived", {}),
            ("carried", self.carried),
        ):
            object.__setattr__(snap, name, value)
        if queued_evicted:
            object.__setattr__(snap, "starved", snap._starved())
        return snap

    def with_entries(
        self, devices: Mapping[str, DeviceSnapshot], engines: Mapping[str, EngineSnapshot]
    ) -> ClusterSnapshot:
        """This snapshot's models and layout with ``devices`` and ``engines`` in place of its own,
        unchecked: the base a body calls :meth:`updated` on to check and apply its changes to the
        devices and engines it last built (:meth:`deferring`)."""
        return self._successor(self.models.copy(), devices, engines, False)

    def replicas(self, model: str) -> tuple[str, ...]:
        """The snapshot names of ``model``'s replica slots, replica 0 (``model`` itself) first."""
        return (model, *self.extra_replicas.get(model, ()))


class _Deferred:
    """The devices and engines of a snapshot from :meth:`ClusterSnapshot.deferring`, until read:
    the entries read one by one so far, then, once read whole, the mappings themselves."""

    __slots__ = ("entries", "entry", "owner", "resolve")

    def __init__(self, resolve: Callable, entry: Callable) -> None:
        self.owner: ClusterSnapshot | None = None
        self.resolve: Callable | None = resolve
        self.entry = entry
        self.entries: dict[tuple[str, str], object] = {}

    def get(self, name: str) -> Mapping:
        owner = self.owner
        if self.resolve is not None:
            devices, engines = self.resolve(owner)
            self.resolve = None
            self.entries.clear()
            # from now on the snapshot holds the mappings themselves
            object.__setattr__(owner, "devices", devices)
            object.__setattr__(owner, "engines", engines)
        return getattr(owner, name)

    def one(self, name: str, key: str) -> object | None:
        """The entry ``key`` of ``name`` (None: there is none)."""
        if self.resolve is None:
            return getattr(self.owner, name).get(key)
        try:
            return self.entries[name, key]
        except KeyError:
            pass
        value, built = self.entry(self.owner, name, key)
        if value is not built and value is not None:
            if name == "devices":
                ok = built is not None and built.models == value.models  # type: ignore[attr-defined]
            else:
                ok = _engine_fits(value, self.owner.models.get(key))  # type: ignore[arg-type]
            if not ok:  # the layout moved: checked whole
                return self.get(name).get(key)
        self.entries[name, key] = value
        return value


class _DeferredEntries(Mapping):
    """A snapshot's devices or engines, built on first read (:meth:`ClusterSnapshot.deferring`);
    every read goes to the mapping it then holds."""

    __slots__ = ("_deferred", "_name")

    def __init__(self, deferred: _Deferred, name: str) -> None:
        self._deferred = deferred
        self._name = name

    def _map(self) -> Mapping:
        return self._deferred.get(self._name)

    def __getitem__(self, key: str):
        value = self._deferred.one(self._name, key)
        if value is None:
            raise KeyError(key)
        return value

    def __iter__(self) -> Iterator[str]:
        return iter(self._map())

    def __len__(self) -> int:
        return len(self._map())

    def __contains__(self, key: object) -> bool:
        return isinstance(key, str) and self._deferred.one(self._name, key) is not None

    def get(self, key: str, default=None):
        value = self._deferred.one(self._name, key)
        return default if value is None else value

    def keys(self):
        return self._map().keys()

    def values(self):
        return self._map().values()

    def items(self):
        return self._map().items()

    def copy(self) -> dict:
        return self._map().copy()

    def __repr__(self) -> str:
        return repr(self._map())


def _engine_fits(e: EngineSnapshot, m: ModelSnapshot | None) -> bool:
    """An engine belongs to a resident model and runs on its rank-0 device."""
    return m is not None and m.state is not ModelState.EVICTED and e.device == m.placement[0]


REPLICA_SEPARATOR = "#"

# A model's latency targets (seconds) when its deployment names none: the deployment config's and
# the runtime's ModelSpec's default.
DEFAULT_TTFT_SLO_S = 1.0
DEFAULT_TPOT_SLO_S = 0.2
# Seconds the placement after a finished activation waits, so that the activations finishing
# meanwhile share one (control/loop.py): the live runtime's and the simulator's default. A placement
# walks every considered model, and at hundreds of models activations finish several times a second;
# but 0 (at once) by default: a placement made at once sees the activated model's queue before its
# engine admits it, and prism's copies for bursts depend on that (control/README.md, "Coalescing").
PLACEMENT_COALESCE_S = 0.0


def replica_name(model: str, index: int) -> str:
    """The name replica ``index`` of ``model`` has in snapshots, actions and bodies: ``model`` itself
    for replica 0, ``model#index`` after it (model names never contain the separator)."""
    return model if index == 0 else f"{model}{REPLICA_SEPARATOR}{index}"


def _index(items: Iterable, attr: str) -> dict:
    out: dict = {}
    for item in items:
        key = getattr(item, attr)
        if key in out:
            raise InvalidSnapshotError(f"duplicate {attr} {key!r} in snapshot")
        out[key] = item
    return out


# Tokens per block of a request's prefix keys (Request.prefix_keys): the granularity at which the
# control plane tracks which replica holds which prompt prefix (control/prefix_index.py). The
# request log hashes prompts at the same size (api/request_log.py LOG_BLOCK_TOKENS).
PREFIX_BLOCK_TOKENS = 64


class Priority(enum.IntEnum):
    """A request's class in admission: under overload ``BATCH`` yields first, then ``STANDARD``
    (control/admission.py). Lower is served first, as in vLLM's ``priority``."""

    INTERACTIVE = 0
    STANDARD = 1
    BATCH = 2


@dataclass(slots=True, frozen=True)
class Origin:
    """Who sent a request, as admission sees it: the tenant (its name, never its key), the tenant's
    priority class and its weight in the fair share of its class (control/fairness.py)."""

    tenant: str = ""
    priority: Priority = Priority.STANDARD
    weight: float = 1.0

    def __post_init__(self) -> None:
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise InvalidSnapshotError(f"tenant {self.tenant!r}: weight must be > 0")
        object.__setattr__(self, "priority", Priority(self.priority))


DEFAULT_ORIGIN = Origin()


@dataclass(slots=True, frozen=True)
class Request:
    """A request as admission sees it: only what decides its deadline, its prefill time and where
    its prompt's prefix may be cached.

    ``prefix_keys``: one key per full ``PREFIX_BLOCK_TOKENS``-token block of the prompt, chained (a
    key names the whole prefix up to the end of its block) and salted by what else changes the KV
    (live: the served model or adapter name), so equal keys mean an equal prefix; () when unknown.
    ``cached_tokens``: the leading prompt tokens expected to be cached on the replica the request is
    routed to (the control loop sets it from its prefix index); admission's prefill estimate counts
    only the rest (:attr:`prefill_tokens`).
    ``origin``: its tenant, class and weight. ``share``: how far its tenant was over its fair share
    of its class when it arrived (0: at or under it; the control loop sets it, control/fairness.py);
    under overload admission drops a lower class first, then a higher share, then a longer prefill.
    """

    req_id: str
    model: str
    arrival: float  # s, on the same clock as `now`
    prompt_tokens: int
    ttft_slo: float  # s; the deadline is arrival + ttft_slo (paper section 6.3)
    prefix_keys: tuple[int, ...] = field(default=(), repr=False)
    cached_tokens: int = 0
    origin: Origin = DEFAULT_ORIGIN
    share: int = 0

    def __post_init__(self) -> None:
        if not math.isfinite(self.arrival):
            raise InvalidSnapshotError(f"{self.req_id}: arrival must be finite")
        if not self.prompt_tokens >= 0:
            raise InvalidSnapshotError(f"{self.req_id}: prompt_tokens must be >= 0")
        if not (self.ttft_slo > 0 and math.isfinite(self.ttft_slo)):
            raise InvalidSnapshotError(f"{self.req_id}: ttft_slo must be > 0")
        if not 0 <= self.cached_tokens <= self.prompt_tokens:
            raise InvalidSnapshotError(f"{self.req_id}: cached_tokens must be in [0, prompt_tokens]")

    @property
    def deadline(self) -> float:
        return self.arrival + self.ttft_slo

    @property
    def prefill_tokens(self) -> int:
        """The prompt tokens its engine is expected to compute: those not cached."""
        return self.prompt_tokens - self.cached_tokens


# ---------------------------------------------------------------------------------------------------
# Actions. The caller applies them in list order: evictions come before the activations that need
# their memory.


@dataclass(slots=True, frozen=True)
class Activate:
    """Load ``model`` onto ``devices`` (one per TP rank, rank order) from host memory."""

    model: str
    devices: tuple[str, ...]

    @property
    def device(self) -> str:
        """The rank-0 device: where the model's engine and its request queue live."""
        return self.devices[0]


@dataclass(slots=True, frozen=True)
class Evict:
    """Unload ``model`` from every device it is on; its weights stay in host memory."""

    model: str


@dataclass(slots=True, frozen=True)
class Migrate:
    """Move ``model`` from ``src`` to ``dst`` (rank order); ranks whose device is unchanged stay."""

    model: str
    src: tuple[str, ...]
    dst: tuple[str, ...]


@dataclass(slots=True, frozen=True)
class SetKVQuota:
    """Cap the KV bytes ``model``'s engine may map on ``device`` (None lifts the cap)."""

    model: str
    device: str
    quota_bytes: int | None


@dataclass(slots=True, frozen=True)
class Enqueue:
    """Put the request into ``device``'s queue (the caller owns the queue objects)."""

    request: Request
    device: str


@dataclass(slots=True, frozen=True)
class Defer:
    """No device can take the model now: hold the request, count it in ``ModelSnapshot.num_queued``
    and submit it again through ``on_request`` after the next ``place`` tick."""

    request: Request
    detail: str


@dataclass(slots=True, frozen=True)
class Dispatch:
    """Start ``request`` on its model's engine on ``device`` now."""

    request: Request
    device: str

    @property
    def engine(self) -> tuple[str, str]:
        return (self.request.model, self.device)


class RejectReason(enum.Enum):
    DEADLINE_MISS = "deadline_miss"  # abort-on-miss: the TTFT deadline cannot be (or was not) met
    NO_CAPACITY = "no_capacity"  # no device can ever hold the model under this policy
    UNKNOWN_MODEL = "unknown_model"
    PROMPT_TOO_LONG = "prompt_too_long"  # the prompt's KV exceeds what its engine can ever hold


@dataclass(slots=True, frozen=True)
class Reject:
    request: Request
    reason: RejectReason
    detail: str


Action = Activate | Evict | Migrate | SetKVQuota | Enqueue | Defer | Dispatch | Reject
