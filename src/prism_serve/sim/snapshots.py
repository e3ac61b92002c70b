"""The simulator's state as the control loop sees it: model, device, engine and cluster snapshots.

The loop asks for a ClusterSnapshot before every policy call (once or twice per arrival), so
building one from scratch would dominate a run. Every snapshot is cached and rebuilt only when what
it reports changed: a model's when the loop marks it stale (``ControlLoop.stale_models``), a
device's when its memory version moves or the loop marks its queue changed, an engine's when the
engine is dirty; devices and engines write their names into the builder's change lists as they
change, so a cluster snapshot visits those alone, not every device and engine. The cluster
snapshot is the previous one updated with the entries rebuilt since (``ClusterSnapshot.updated``:
as strictly validated as a fresh build, in time proportional to the change while placements stay
put).

Its devices and engines are built only when a policy reads them (``ClusterSnapshot.deferring``),
while the placements stay put: at most arrivals a policy reads the arriving model alone, or the
devices and engines of its replicas, and the steps in between change most devices and engines. A
read of one entry builds that entry; any other read builds the changed ones whole, against those
last built. Either builds them as they are, which is as they were when the snapshot was taken only
until the state changes: the simulator seals the snapshot before each event and each effect the
loop asks for, and a read after that raises (the loop reads a snapshot only during the policy call
it was built for).
"""

from __future__ import annotations

from collections.abc import Mapping

from prism_serve.control import ClusterSnapshot, DeviceSnapshot, EngineSnapshot, ModelProfile, ModelSnapshot
from prism_serve.control.loop import ControlLoop
from prism_serve.control.profiles import measured_profile
from prism_serve.control.types import ModelState
from prism_serve.sim.errors import SimStateError
from prism_serve.sim.memory import SimDevice
from prism_serve.sim.state import SimModel

__all__ = ["SnapshotBuilder"]


class SnapshotBuilder:
    """Snapshots of one simulator's state, cached per entry (see the module docstring). It reads the
    simulator's containers in place: its models (and replica slots), devices, the models placed on
    each device, and the control loop's queues, rates and stale marks. ``live_profiles``: the
    policies see what the live controller would have measured (SimConfig.profiles == "live")."""

    def __init__(
        self,
        models: Mapping[str, SimModel],
        devices: Mapping[str, SimDevice],
        on_device: Mapping[str, Mapping[str, None]],
        loop: ControlLoop,
        replica_of: Mapping[str, str],
        *,
        live_profiles: bool,
        max_num_seqs: int,
        changed_devices: dict[str, None],
        changed_engines: dict[str, None],
    ) -> None:
        self.models = models
        self.devices = devices
        self.on_device = on_device
        self.loop = loop
        self.replica_of = replica_of
        self._live_profiles = live_profiles
        self._max_num_seqs = max_num_seqs
        self._models: dict[str, ModelSnapshot] = {}
        self._rebuilt: dict[str, None] = {}  # models whose snapshot changed since the last cluster()
        self._fields: dict[str, tuple] = {}  # by model: what its snapshot reports that can change
        # models with an engine, in the models' order: the only ones cluster() looks at for engines
        # (an engine comes and goes only with a change that marks its model stale)
        self._order = {name: i for i, name in enumerate(models)}
        self._engined: dict[str, None] = {}
        self._devices: dict[str, tuple[int, DeviceSnapshot]] = {}  # by device: (memory version, snap)
        self._device_order = {d: i for i, d in enumerate(devices)}
        # What may differ from the last cluster snapshot, so that cluster() looks at nothing else:
        # devices whose memory changed (SimDevice writes its name here) or whose snapshot was rebuilt
        # since (admission_view); engines that turned dirty (SimEngine writes its name here) or whose
        # snapshot was rebuilt since; models whose engine went away. Devices the loop marks stale are
        # its own set.
        self._changed_devices = changed_devices
        self._changed_engines = changed_engines
        self._unengined: dict[str, None] = {}
        self._last: ClusterSnapshot | None = None
        # the devices and engines as last built, and the last snapshot whose own are not built yet
        # (ClusterSnapshot.deferring): built when first read, unless the state changed since
        self._entries: tuple[Mapping[str, DeviceSnapshot], Mapping[str, EngineSnapshot]] = ({}, {})
        self._open: ClusterSnapshot | None = None
        self._stale = loop.stale_models  # models whose snapshot must be rebuilt
        self._stale.update(dict.fromkeys(models))
        # what a model's snapshot reports that never changes (its shape's sizes are computed)
        self._fixed = {
            name: (m.slo.ttft_s, m.slo.tpot_s, m.served.spec.weight_bytes, m.served.spec.kv_bytes_per_token)
            for name, m in models.items()
        }

    def model(self, m: SimModel, now: float) -> ModelSnapshot:
        sv = m.served
        name = sv.name
        cached = self._models.get(name)
        if name not in self._stale and cached is not None:
            return cached
        self._stale.pop(name, None)
        loop = self.loop
        rates = loop.rates
        fields = (
            rates.rate(name, now),
            m.placement,
            m.state,
            _latest(rates.last_arrival(name), m.activated_at),
            loop.num_queued.get(name, 0),  # get: a Counter's missing key goes through __missing__
            m.num_running,
            self.profile(m) if self._live_profiles else m.profile,
            m.placed_at,
            loop.forecast_rate(name, now),
            m.state is not ModelState.EVICTED and name in loop.prewarmed,
        )
        # a tick marks every model stale (rates move with time), but most report the same figures:
        # keep their snapshot (frozen, so an equal one is the same to every reader), and with it
        # the cluster snapshot's work proportional to what changed
        if cached is not None and fields == self._fields[name]:
            return cached
        self._fields[name] = fields
        self._rebuilt[name] = None
        rate, placement, state, last, queued, running, profile, placed_at, forecast, prewarmed = fields
        ttft_s, tpot_s, weight_bytes, kv_bytes_per_token = self._fixed[name]
        self._models[name] = snap = ModelSnapshot(
            name,
            rate,
            ttft_s,
            tpot_s,
            weight_bytes,
            kv_bytes_per_token,
            sv.tp_size,
            placement,
            state,
            last,
            queued,
            running,
            False,
            profile,
            placed_at=placed_at,
            placed_history_s=rates.history_at(self.replica_of.get(name, name), placed_at),
            forecast_rate=forecast,
            prewarmed=prewarmed,
            replica_of=self.replica_of.get(name),
            expected_rate=None if name in self.replica_of else sv.expected_rate,
        )
        return snap

    def profile(self, m: SimModel) -> ModelProfile:
        if self._live_profiles:  # what the live controller knows: measured, or the default before
            return measured_profile(
                ModelProfile(),
                m.busy_seconds,
                m.num_served,
                m.steps,
                m.slo.tpot_s,
                self._max_num_seqs,
            )
        return m.profile

    def _cached_device(self, d: str) -> DeviceSnapshot | None:
        """The device's cached snapshot if still current: memory and placement changes bump the
        device's version, queue changes are the loop's marks."""
        cached = self._devices.get(d)
        if cached is None or cached[0] != self.devices[d].version or d in self.loop.stale_devices:
            return None
        return cached[1]

    def device(self, d: str) -> DeviceSnapshot:
        if (cached := self._cached_device(d)) is not None:
            return cached
        self.loop.stale_devices.discard(d)
        dev = self.devices[d]
        q = self.loop.queues[d]
        snap = DeviceSnapshot(
            d, dev.capacity_bytes, dev.mapped_bytes, tuple(self.on_device[d]), len(q), q.models()
        )
        self._devices[d] = (dev.version, snap)
        self._changed_devices[d] = None
        return snap

    @staticmethod
    def _cached_engine(m: SimModel) -> EngineSnapshot | None:
        """The model's cached engine snapshot if its engine has not changed since."""
        return None if m.engine is None or m.engine.dirty else m.engine_snapshot

    def engine(self, name: str) -> EngineSnapshot | None:
        m = self.models[name]
        e = m.engine
        if e is None:
            return None
        if (cached := self._cached_engine(m)) is not None:
            return cached
        e.dirty = False
        rank0 = e.devices[0]
        used = e.used_blocks * e.block_bytes
        limit = rank0.capacity_bytes - rank0.weight_pages.get(name, 0) * rank0.page_size
        if e.quota is not None:
            limit = min(limit, e.quota)
        snap = EngineSnapshot(
            name,
            rank0.name,
            e.kv_bytes_per_token,
            True,
            max(0, rank0.kv_mapped_bytes(name) - used),
            used + e.claimed_bytes(),
            e.quota,
            max(0, limit),
            e.num_requests,
            e.max_num_seqs,
            m.prefill_speed,
            len(e.waiting),
            kv_window=e.kv_window,
        )
        m.engine_snapshot = snap
        self._changed_engines[name] = None
        return snap

    def admission_view(self, device: str, now: float) -> tuple[DeviceSnapshot, dict[str, EngineSnapshot]]:
        self.seal()
        engines = {
            name: snap
            for name in self.on_device[device]
            if (snap := self.engine(name)) is not None and snap.device == device
        }
        return self.device(device), engines

    def cluster(self, now: float) -> ClusterSnapshot:
        self.seal()
        models = self.models
        stale = list(self._stale)
        for name in stale:
            self.model(models[name], now)
        engined = self._engined
        added = False
        for name in stale:  # only a stale model can have gained or lost its engine
            if models[name].engine is None:
                if name in engined:
                    del engined[name]
                    self._unengined[name] = None
            elif name not in engined:
                engined[name] = None
                added = True
        if added:
            order = self._order
            self._engined = dict.fromkeys(sorted(engined, key=order.__getitem__))
        changed = [self._models[name] for name in self._rebuilt]
        self._rebuilt.clear()
        last = self._last
        if last is None:
            devices = {d: self.device(d) for d in self.devices}
            engines = {n: self.engine(n) for n in self._engined}
            snap = ClusterSnapshot(self._models, devices, engines)
            self._clear_changes()
            self._entries = (snap.devices, snap.engines)
        else:
            snap = last.deferring(changed, self._resolve, self._entry)
            if snap is None:  # the layout changed: checked against every device and engine now
                snap = last.with_entries(*self._entries).updated(changed, *self._changed_entries())
                self._entries = (snap.devices, snap.engines)
            else:
                self._open = snap
        self._last = snap
        return snap

    def seal(self) -> None:
        """The state is about to change: the last cluster snapshot's devices and engines, if no
        one has read them yet, can no longer be built as they were (reading them raises)."""
        self._open = None

    def _resolve(
        self, snap: ClusterSnapshot
    ) -> tuple[Mapping[str, DeviceSnapshot], Mapping[str, EngineSnapshot]]:
        """The devices and engines of ``snap`` (ClusterSnapshot.deferring), on its first read."""
        if snap is not self._open:
            raise SimStateError("a cluster snapshot's devices or engines were read after the state changed")
        self._open = None
        resolved = snap.with_entries(*self._entries).updated((), *self._changed_entries())
        self._entries = (resolved.devices, resolved.engines)
        return self._entries

    def _entry(self, snap: ClusterSnapshot, kind: str, name: str) -> tuple[object | None, object | None]:
        """One device or engine of ``snap`` (ClusterSnapshot.deferring) on its first read: (it now,
        it as last built); it stays among the changed ones until the snapshot is built whole."""
        if snap is not self._open:
            raise SimStateError("a cluster snapshot's devices or engines were read after the state changed")
        devices, engines = self._entries
        if kind == "devices":
            built = devices.get(name)
            if name in self._changed_devices or name in self.loop.stale_devices:
                return self.device(name), built
            return built, built
        built = engines.get(name)
        if name not in self._engined:
            return None, built
        if name in self._changed_engines:
            return self.engine(name), built
        return built, built

    def _changed_entries(self) -> tuple[list[DeviceSnapshot], list[EngineSnapshot], list[str]]:
        """The devices and engines changed since they were last built, in the order a full pass
        would visit them, and the engines gone since."""
        stale_devices = self.loop.stale_devices
        touched = self._changed_devices.keys() | stale_devices if stale_devices else self._changed_devices
        devices = [self.device(d) for d in sorted(touched, key=self._device_order.__getitem__)]
        engined = self._engined
        dirty = [n for n in self._changed_engines if n in engined]
        engines = [self.engine(n) for n in sorted(dirty, key=self._order.__getitem__)]
        built = self._entries[1]
        gone = [n for n in self._unengined if n in built and n not in engined]
        self._clear_changes()
        return devices, engines, gone

    def _clear_changes(self) -> None:
        self._changed_devices.clear()
        self._changed_engines.clear()
        self._unengined.clear()


def _latest(a: float | None, b: float | None) -> float | None:
    return b if a is None else a if b is None else max(a, b)
