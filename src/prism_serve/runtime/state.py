"""What the controller knows per model: each served model's and replica slot's record
(``ModelEntry``) in one ``ModelTable``, what the API shows of them (``ModelStatus``), and the
ClusterSnapshot built from that state for every policy call."""

from __future__ import annotations

import asyncio
import functools
import json
import threading
from collections.abc import ItemsView, Iterable, Iterator, Mapping, ValuesView
from dataclasses import dataclass, field, replace
from pathlib import Path

from prism_serve.control import (
    ClusterSnapshot,
    DeviceSnapshot,
    EngineSnapshot,
    ModelProfile,
    ModelSnapshot,
    ModelState,
)
from prism_serve.control.loop import ControlLoop
from prism_serve.control.profiles import StepSums, measured_profile
from prism_serve.control.types import REPLICA_SEPARATOR, replica_name
from prism_serve.engine.config import PoolingTask, resolve_max_model_len
from prism_serve.engine.kv_cache import KVGroups
from prism_serve.engine.llm_engine import torch_dtype
from prism_serve.engine.lora import LoraSlots
from prism_serve.engine.sources import VLLM_ENCODER_TYPES
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.engine.vllm_engine import lora_slot_bytes
from prism_serve.errors import quoted
from prism_serve.memory.ledger import DeviceLedger
from prism_serve.runtime import messages as msg
from prism_serve.runtime.adapters import AdapterTable
from prism_serve.runtime.cluster import LedgerMirror
from prism_serve.runtime.devices import DeviceSpec
from prism_serve.runtime.models import ModelSpec, UnknownModelError
from prism_serve.runtime.weight_cache import CachedModel, config_from_dict
from prism_serve.runtime.workers import WorkerHandle

# a tensor parallel model's fixed KV without a kv_limit: room for this many requests of
# max_model_len tokens (ModelEntry.tp_kv_blocks)
TP_KV_REQUESTS = 4


@dataclass(eq=False)
class ModelEntry:
    spec: ModelSpec
    cached: CachedModel
    tokenizer: Tokenizer
    max_model_len: int  # prompt plus output tokens of one request (the engine's context rule)
    state: ModelState = ModelState.EVICTED
    device: str | None = None
    worker: WorkerHandle | None = None
    pinned: bool = False
    kv_quota: int | None = None
    num_running: int = 0
    activation: asyncio.Task | None = None
    last_phases: msg.ActivationPhases | None = None
    max_kv_bytes: int | None = None
    num_activations: int = 0
    num_evictions: int = 0
    activated_at: float | None = None
    placed_at: float | None = None  # when its current placement was decided (prism's migration cooldown)
    # engine step (wall) and worker CPU seconds over every activation, from the workers' stats
    step_seconds: float = 0.0
    cpu_seconds: float = 0.0
    busy_seconds: float = 0.0  # the steps as each would take alone (EngineStats.busy_seconds)
    num_served: int = 0  # requests that left its engine (finished, failed or aborted there)
    # its engines' decode steps over every activation (the profile's step-time fit)
    decode: StepSums = field(default_factory=StepSums)
    # a replica slot of the served model named here (control/replicas.py): the same spec under its
    # slot name, the same host weights and tokenizer; None for the served model itself
    replica_of: str | None = None
    # its LoRA adapter slots (engine.max_loras > 0): device memory mapped with the weights
    adapter_bytes: int = 0
    # a tensor parallel model (spec.tp > 1) while resident: every rank's device (rank 0's is
    # ``device``) and the workers of ranks 1.. (rank 0's is ``worker``, which takes the requests)
    devices: tuple[str, ...] = ()
    followers: list[WorkerHandle] = field(default_factory=list)

    def __setattr__(self, name: str, value: object) -> None:
        # every assignment reports the entry to its table's ``changed`` (Snapshots rebuilds its
        # model snapshot), once the table has handed it one
        object.__setattr__(self, name, value)
        changed = self.__dict__.get("report_to")
        if changed is not None:
            changed[self.spec.name] = None

    @property
    def device_bytes(self) -> int:
        """What an activation maps on a device besides KV: the weights and the adapter slots (a
        tensor parallel model: on each of its devices, its largest rank's shard)."""
        shards = self.cached.files.values()
        return max(shards) + self.adapter_bytes

    @property
    def device_kv_bytes_per_token(self) -> int:
        """KV bytes a token takes on a device (a tensor parallel model: on its largest rank's)."""
        return max((r.kv_bytes_per_token for r in self.cached.ranks), default=self.cached.kv_bytes_per_token)

    @property
    def host_bytes(self) -> int:
        """Its weights over all its devices (every rank's shard), with the adapter slots."""
        return sum(self.cached.files.values()) + self.adapter_bytes

    @property
    def ranks(self) -> list[WorkerHandle]:
        """The workers it runs on, rank 0 first (resident or activating)."""
        return [self.worker, *self.followers] if self.worker is not None else []

    @functools.cached_property
    def kv_groups(self) -> KVGroups:
        """How its engine splits its layers' KV (engine/kv_cache.py KVGroups; every rank alike):
        fixed by its weights and settings, so found once."""
        split = self.spec.engine_kind == "builtin" and self.spec.engine.windowed_kv
        return KVGroups.of(config_from_dict(self.cached.config), self.max_model_len, split)

    @functools.cached_property
    def encoder(self) -> bool:
        """An encoder (bidirectional: each input read whole and pooled) keeps no KV: the built-in
        engine's BERT family, or an encoder on vLLM's engine (engine/sources.py VLLM_ENCODER_TYPES)."""
        arch = config_from_dict(self.cached.config)
        return arch.encoder or (self.spec.engine_kind == "vllm" and arch.architecture in VLLM_ENCODER_TYPES)

    @functools.cached_property
    def engine_kv_split(self) -> tuple[int, tuple[int, int] | None]:
        """KV bytes a token takes in its engine on one device (rank 0's): every layer's, or for a
        built-in engine whose sliding-window layers free what their window has passed, the
        full-context layers' per token and the windowed ones' (tokens held at most: the window, a
        step's chunk and a block each side; bytes per token); 0 for an encoder, which keeps no KV.
        Found once."""
        if self.encoder:
            return 0, None
        rank = self.cached.ranks[0] if self.spec.tp > 1 else self.cached
        engine = self.spec.engine
        return self.kv_groups.kv_split(
            rank.kv_bytes_per_token, engine.max_num_batched_tokens, engine.block_size
        )

    def tp_kv_blocks(self) -> int:
        """A tensor parallel model's KV blocks, fixed at activation and the same on every rank:
        ``kv_limit`` of its largest rank's KV if set, else room for ``TP_KV_REQUESTS`` requests
        of ``max_model_len`` tokens."""
        per_token = self.device_kv_bytes_per_token
        limit = self.spec.kv_limit_bytes
        tokens = limit // per_token if limit is not None else TP_KV_REQUESTS * self.max_model_len
        blocks = max(1, tokens // self.spec.engine.block_size)
        # windowed layers apart (kv_groups): a block holds one group's layers, so the same bytes
        # make more, smaller blocks
        groups = self.kv_groups
        return blocks * len(groups.group_of) // groups.layers_per_group

    def left_devices(self) -> None:
        """No longer resident anywhere."""
        self.state, self.device, self.devices, self.worker, self.followers = (
            ModelState.EVICTED, None, (), None, [],
        )  # fmt: skip

    def profile(self) -> ModelProfile:
        """The per-request costs the control plane predicts compute demand from: engine step seconds
        per request served, each step as it would take alone (CPU-timed, ``busy_seconds``: on a
        shared core the wall time also holds the neighbours' slices, and the policies add the
        contention of a placement themselves), measured over every activation, once a few requests
        make it meaningful,
        and the replica capacity prism scales replicas by: its inverse, requests served per second
        of stepping, times the batching the decode-step fit leaves room for within the TPOT SLO
        (control/profiles.py)."""
        return measured_profile(
            ModelProfile(),
            self.busy_seconds,
            self.num_served,
            self.decode,
            self.spec.tpot_slo,
            self.spec.engine.max_num_seqs,
        )

    def count_engine_time(self, before: msg.EngineStats | None, after: msg.EngineStats) -> None:
        """Add what the engine used between two stats of one activation (``before`` None: its first)."""
        self.step_seconds += max(0.0, after.step_seconds - (before.step_seconds if before else 0.0))
        if after.decode_sums:
            was = StepSums(*before.decode_sums) if before is not None and before.decode_sums else StepSums()
            self.decode = self.decode + (StepSums(*after.decode_sums) - was)
        self.cpu_seconds += max(0.0, after.cpu_seconds - (before.cpu_seconds if before else 0.0))
        self.busy_seconds += max(0.0, after.busy_seconds - (before.busy_seconds if before else 0.0))

    def activate_message(
        self, decided_at: float, adapters: Iterable[msg.AdapterFile] = (), rank: int = 0, tp_init: str = ""
    ) -> msg.ActivateModel:
        """What a worker needs to activate this model from the host cache (with ``adapters``
        registered in its engine); a tensor parallel model's ``rank``, its group meeting at
        ``tp_init``."""
        c = self.cached
        shard = c.ranks[rank] if c.ranks else c
        return msg.ActivateModel(
            engine_kind=self.spec.engine_kind,
            model=self.spec.name,
            cache_path=shard.path,
            tensors=list(shard.tensors),
            weight_bytes=shard.weight_bytes,
            config=shard.config,
            tokenizer_path=c.tokenizer_path,
            source=c.source,
            synthetic=c.synthetic,
            engine=self.spec.engine,
            sent_at=decided_at,
            kv_limit_bytes=self.spec.kv_limit_bytes,
            adapters=list(adapters),
            adapter_bytes=self.adapter_bytes,
            tp_rank=rank,
            tp_size=self.spec.tp,
            tp_init=tp_init,
            kv_blocks=self.tp_kv_blocks() if c.ranks else 0,
        )


@dataclass(frozen=True, slots=True)
class ModelStatus:
    """What the API shows of one model (Controller.status()): the server reads the controller's
    ModelEntry and ModelSpec records only through this."""

    model: str
    state: str  # "active", "loading" or "evicted"
    device: str | None
    worker: str | None
    pinned: bool
    weight_bytes: int
    num_running: int
    num_queued: int
    num_activations: int
    num_evictions: int
    last_activation: msg.ActivationPhases | None
    used_kv_bytes: int = 0  # the engine's KV in use (worker's last step report)
    max_kv_bytes: int | None = None  # the most KV the engine could map on its device
    step_seconds: float = 0.0  # engine step (wall) seconds over all activations
    cpu_seconds: float = 0.0  # its workers' CPU seconds over all activations
    # fixed while the server runs
    source: str = ""  # weights source, as the host cache resolved it
    synthetic: bool = False  # random weights
    ttft_slo: float = 0.0  # s
    tpot_slo: float = 0.0  # s
    max_model_len: int = 0  # prompt plus output tokens of one request
    vocab_size: int = 0  # token ids must be below this
    # every resident replica, replica 0 first if resident (control/replicas.py); the fields above
    # are the served model's: state the best of its replicas', device and worker its first resident
    # replica's, counts and seconds summed over replicas
    replicas: tuple[ReplicaStatus, ...] = ()
    dtype: str = ""  # float32 or bfloat16 (dtype auto resolved on this machine)
    sampling: tuple[tuple[str, float | int], ...] = ()  # defaults for requests that leave them out
    tp: int = 1  # tensor parallel degree
    devices: tuple[str, ...] = ()  # a resident tensor parallel model's devices, rank 0 first
    # KV blocks its engines' prefix caches keep that no request holds: reclaimable, not in use
    cached_kv_bytes: int = 0
    pooled: PoolingTask | None = None  # an embedder's or a reranker's task; None: it generates
    hidden_size: int = 0  # the width of its hidden states (an embedding's length)

    @classmethod
    def of(cls, entries: list[tuple[ModelEntry, int]]) -> ModelStatus:
        """The served model ``entries[0][0]`` with its replica slots after it, each with its number
        of waiting requests."""
        m = entries[0][0]
        reps = [
            ReplicaStatus.of(e, q, i) for i, (e, q) in enumerate(entries) if e.state is not ModelState.EVICTED
        ]
        first = reps[0] if reps else None
        state = min((r.state for r in reps), key=_STATE_ORDER.index, default="evicted")
        done = [e for e, _ in entries if e.last_phases is not None]
        last = max(done, key=lambda e: e.activated_at or 0.0).last_phases if done else None
        kv = [r.max_kv_bytes for r in reps if r.max_kv_bytes is not None]
        return cls(
            m.spec.name, state, first.device if first else None, first.worker if first else None,
            m.pinned, m.host_bytes, sum(e.num_running for e, _ in entries),
            sum(q for _, q in entries), sum(e.num_activations for e, _ in entries),
            sum(e.num_evictions for e, _ in entries), last, sum(r.used_kv_bytes for r in reps),
            sum(kv) if kv else None, sum(e.step_seconds for e, _ in entries),
            sum(e.cpu_seconds for e, _ in entries), m.cached.source, m.cached.synthetic,
            m.spec.ttft_slo, m.spec.tpot_slo, m.max_model_len, int(m.cached.config["vocab_size"]),
            tuple(reps), m.spec.engine.dtype, m.spec.sampling, m.spec.tp, m.devices if m.spec.tp > 1 else (),
            sum(r.cached_kv_bytes for r in reps), m.spec.pooled, int(m.cached.config["hidden_size"]),
        )  # fmt: skip


_STATE_ORDER = ["active", "loading", "evicted"]


@dataclass(frozen=True, slots=True)
class ReplicaStatus:
    """One resident replica of a served model (ModelStatus.replicas)."""

    replica: int  # slot index; 0 is the served model's own engine
    name: str  # its name in snapshots and logs (control.types.replica_name)
    state: str  # "active" or "loading"
    device: str | None
    worker: str | None
    num_running: int
    num_queued: int
    used_kv_bytes: int
    max_kv_bytes: int | None
    num_served: int  # requests that left this replica's engine, over all its activations
    cached_kv_bytes: int = 0  # its prefix cache's unheld blocks (reclaimable)

    @classmethod
    def of(cls, m: ModelEntry, num_queued: int, index: int) -> ReplicaStatus:
        state = {"active": "active", "activating": "loading", "evicted": "evicted"}[m.state.value]
        stats = m.worker.stats if m.worker is not None and m.state is ModelState.ACTIVE else None
        return cls(
            index, m.spec.name, state, m.device, m.worker.worker_id if m.worker else None, m.num_running,
            num_queued, stats.used_kv_bytes if stats else 0, m.max_kv_bytes if stats else None,
            m.num_served, stats.cached_kv_bytes if stats else 0,
        )  # fmt: skip


def _latest(*times: float | None) -> float | None:
    known = [t for t in times if t is not None]
    return max(known) if known else None


def model_entries(
    spec: ModelSpec, cached: CachedModel, replica_slots: list[str], tok: Tokenizer
) -> dict[str, ModelEntry]:
    """The entries of a model whose weights are in the host cache: itself and each of its replica
    slots, under the slot's name over the same host weights and tokenizer ``tok``."""
    arch = config_from_dict(cached.config)
    max_len = resolve_max_model_len(spec.engine.max_model_len, arch)
    e = spec.engine
    if not e.max_loras:
        slots = 0
    elif spec.engine_kind == "builtin":
        slots = LoraSlots.bytes_for(arch, e.max_loras, e.max_lora_rank, torch_dtype(e)) + msg.ADAPTER_ALIGN
    else:  # vLLM's own slots, moved into the weight range after the data parameters
        slots = lora_slot_bytes(arch, e.max_loras + 1, e.max_lora_rank, torch_dtype(e).itemsize)
    out = {spec.name: ModelEntry(spec, cached, tok, max_len, pinned=spec.pinned, adapter_bytes=slots)}
    for slot in replica_slots:
        out[slot] = ModelEntry(
            replace(spec, name=slot), cached, tok, max_len, replica_of=spec.name, adapter_bytes=slots
        )
    return out


class ModelTable(Mapping[str, ModelEntry]):
    """Every served model and replica slot, by the name the control loop and the workers use (a
    slot is ``<model>#k``, control/replicas.py); ``specs`` holds the served models alone, the names
    clients may ask for. Entries are added once their weights are in the host cache."""

    def __init__(self, specs: Iterable[ModelSpec], num_slots: int) -> None:
        self.specs = {m.name: m for m in specs}
        self.adapters = AdapterTable()  # LoRA adapters: clients address them as models of their base
        if bad := [n for n in self.specs if REPLICA_SEPARATOR in n]:
            raise ValueError(f"model names must not contain {REPLICA_SEPARATOR!r} (replica slots): {bad}")
        # replica slots beyond replica 0 per served model, at most one per device
        self.replicas = {name: [replica_name(name, k) for k in range(1, num_slots)] for name in self.specs}
        self._entries: dict[str, ModelEntry] = {}
        # entries added or with an attribute set since a reader (Snapshots) last cleared it
        self.changed: dict[str, None] = {}
        # by the host cache's tokenizer file: models over the same weights (fine-tunes sharing a
        # file, a base served under many names) share one tokenizer, which takes a fifth of a
        # second and megabytes to build
        self._tokenizers: dict[str, Tokenizer] = {}

    def names(self) -> list[str]:
        """Every served model followed by its replica slots."""
        return [n for name in self.specs for n in (name, *self.replicas[name])]

    def add(self, spec: ModelSpec, cached: CachedModel) -> None:
        path = cached.tokenizer_path
        tok = self._tokenizers.get(path)
        if tok is None:
            tok = self._tokenizers[path] = Tokenizer.from_state(json.loads(Path(path).read_text()))
        entries = model_entries(spec, cached, self.replicas[spec.name], tok)
        for name, entry in entries.items():
            object.__setattr__(entry, "report_to", self.changed)
            self.changed[name] = None
        self._entries.update(entries)

    def __getitem__(self, name: str) -> ModelEntry:
        return self._entries[name]

    def items(self) -> ItemsView[str, ModelEntry]:  # the dict's own: Mapping's calls __getitem__ per key
        return self._entries.items()

    def values(self) -> ValuesView[ModelEntry]:
        return self._entries.values()

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def entry(self, name: str) -> ModelEntry:
        """A served model or a replica slot (the loop's and the workers' names)."""
        m = self._entries.get(name)
        if m is None:
            raise UnknownModelError(f"model {quoted(name)} is not served here; see /v1/models")
        return m

    def served(self, name: str) -> ModelEntry:
        """A model clients may address (replica slots are internal names); an adapter's name gives
        its base's entry."""
        adapter = self.adapters.get(name)
        if adapter is not None:
            name = adapter.base
        if name not in self.specs:
            raise UnknownModelError(f"model {quoted(name)} is not served here; see /v1/models")
        return self._entries[name]

    def tokenizer(self, name: str) -> Tokenizer:
        return self.served(name).tokenizer

    def slots(self, name: str) -> list[ModelEntry]:
        """The served model ``name`` and its replica slots."""
        return [self.served(name), *(self._entries[n] for n in self.replicas[name])]

    def status(self, snap: ClusterSnapshot) -> list[ModelStatus]:
        """One status per served model, its replicas inside (waiting requests from ``snap``)."""
        return [
            ModelStatus.of([(m, snap.models[m.spec.name].num_queued) for m in self.slots(name)])
            for name in self.specs
        ]


def _model_snapshot(name: str, m: ModelEntry, loop: ControlLoop, now: float) -> ModelSnapshot:
    rates = loop.rates
    resident = m.state is not ModelState.EVICTED
    tp = m.spec.tp
    return ModelSnapshot(
        model=name,
        rate=rates.rate(name, now),
        ttft_slo=m.spec.ttft_slo,
        tpot_slo=m.spec.tpot_slo,
        # a tensor parallel model: 1/tp of these on each device, as its largest rank takes
        weight_bytes=tp * m.device_bytes,
        kv_bytes_per_token=tp * m.device_kv_bytes_per_token,
        tp_size=tp,
        placement=(m.devices or (m.device,)) if resident else (),
        state=m.state,
        last_request_time=_latest(rates.last_arrival(name), m.activated_at),
        placed_at=m.placed_at if resident else None,
        placed_history_s=rates.history_at(m.replica_of or name, m.placed_at) if resident else None,
        num_queued=loop.num_queued.get(name, 0),
        num_running=m.num_running,
        pinned=m.pinned and m.replica_of is None,
        profile=m.profile(),
        replica_of=m.replica_of,
        keep_alive_s=m.spec.keep_alive_s,
        forecast_rate=loop.forecast_rate(name, now),
        prewarmed=resident and name in loop.prewarmed,
        expected_rate=None if m.replica_of is not None else m.spec.expected_rate,
    )


def _model_inputs(name: str, m: ModelEntry, loop: ControlLoop, now: float) -> tuple:
    """What ``_model_snapshot`` reads that can change, as read now: equal inputs, equal snapshots
    (a tenth of the time to read; ``Snapshots`` rebuilds the others)."""
    rates = loop.rates
    return (
        rates.rate(name, now), m.state, m.device, m.devices, rates.last_arrival(name), m.activated_at,
        m.placed_at, loop.num_queued.get(name, 0), m.num_running, m.pinned, m.busy_seconds, m.num_served,
        m.decode, loop.forecast_rate(name, now), name in loop.prewarmed,
    )  # fmt: skip


def _engine_snapshot(name: str, m: ModelEntry) -> EngineSnapshot:
    stats = m.worker.stats if m.worker is not None else None
    per_token, window = m.engine_kv_split
    return EngineSnapshot(
        model=name,
        device=m.device,
        kv_bytes_per_token=per_token,
        kv_window=window,
        ready=m.state is ModelState.ACTIVE,
        free_kv_bytes=max(0, stats.mapped_kv_bytes - stats.used_kv_bytes) if stats else 0,
        used_kv_bytes=stats.used_kv_bytes if stats else 0,
        kv_quota_bytes=m.kv_quota,
        max_kv_bytes=m.max_kv_bytes,
        num_running=m.num_running,
        max_num_seqs=m.spec.engine.max_num_seqs,
        prefill_tokens_per_s=stats.prefill_tokens_per_s if stats else None,
        # the worker's count is one step old: never more than the requests booked on it
        num_waiting=min(stats.num_waiting, m.num_running) if stats else 0,
    )


def _device_snapshots(
    models: Mapping[str, ModelEntry],
    resident: Iterable[str],
    devices: Mapping[str, DeviceSpec],
    ledgers: Mapping[str, DeviceLedger | LedgerMirror],
    loop: ControlLoop,
) -> list[DeviceSnapshot]:
    on_device: dict[str, list[str]] = {d: [] for d in devices}
    for name in resident:
        m = models[name]
        for d in m.devices or (m.device,):
            on_device[d].append(name)
    out = []
    for d, spec in devices.items():
        q = loop.queues[d]
        out.append(
            DeviceSnapshot(
                device=d,
                capacity_bytes=spec.memory_bytes,
                mapped_bytes=ledgers[d].peek().engine_bytes,  # spare pages and cached KV go on demand
                models=tuple(on_device[d]),
                num_queued=len(q),
                queued_models=q.models(),
            )
        )
    return out


def cluster_snapshot(
    models: Mapping[str, ModelEntry],
    devices: Mapping[str, DeviceSpec],
    ledgers: Mapping[str, DeviceLedger | LedgerMirror],
    loop: ControlLoop,
    now: float,
) -> ClusterSnapshot:
    """Every model, device and engine as the controller's state shows them at ``now``: device bytes
    read from the ledgers, engine KV from the workers' last stats, rates, queues and waiting requests
    (queued on a device or deferred) from the control loop. Built afresh (``Snapshots`` builds the
    same one from what changed)."""
    resident = [n for n, m in models.items() if m.state is not ModelState.EVICTED]
    return ClusterSnapshot.build(
        [_model_snapshot(n, m, loop, now) for n, m in models.items()],
        _device_snapshots(models, resident, devices, ledgers, loop),
        [_engine_snapshot(n, models[n]) for n in resident],
    )


class SnapshotMismatchError(AssertionError):
    """``Snapshots`` built a snapshot that differs from a fresh build (checked when asked)."""


class Snapshots:
    """The controller's cluster snapshots, each the last one with what changed since rebuilt: a
    fresh build reads every model (30 us each: 0.3 s at 10,000 models, before every policy call of
    every arrival), most of which are evicted and idle and read the same as last time.

    A model's snapshot is rebuilt when something it reports may have changed: an attribute of its
    ``ModelEntry`` was set (the table's entries report every assignment, ``ModelTable.changed``),
    the control loop marked it stale (arrivals, queues, prewarming, held: ``stale_models``), its
    rate moves with time (arrivals in the window), it is resident (few, and their figures move with
    every step), or a new forecast window began (every model). Devices and engines are rebuilt
    every time (one per device and per resident model). The result is the last snapshot
    ``updated`` with the changed entries, checked as strictly as a fresh build; with ``check``, each
    is also compared with a fresh build (``cluster_snapshot``), which the tests turn on
    (``PRISM_CHECK_SNAPSHOTS=1``)."""

    def __init__(
        self,
        models: ModelTable,
        devices: Mapping[str, DeviceSpec],
        ledgers: Mapping[str, DeviceLedger | LedgerMirror],
        loop: ControlLoop,
        *,
        check: bool = False,
    ) -> None:
        self.models = models
        self.devices = devices
        self.ledgers = ledgers
        self.loop = loop
        self.check = check
        self._last: ClusterSnapshot | None = None
        self._snaps: dict[str, ModelSnapshot] = {}
        self._inputs: dict[str, tuple] = {}  # by model: _model_inputs when its snapshot was built
        self._lock = threading.Lock()
        self._window: int | None = None

    def cluster(self, now: float) -> ClusterSnapshot:
        with self._lock:  # the loop builds; a caller on another thread (a test's status()) may too
            try:
                return self._cluster(now)
            except BaseException:
                self._last = None  # half rebuilt: the next one starts afresh
                raise

    def _cluster(self, now: float) -> ClusterSnapshot:
        models, loop, last = self.models, self.loop, self._last
        window = loop.forecast.window(now)
        if last is None or list(last.devices) != list(self.devices):
            snap = self._fresh(now)
        else:
            snap = self._updated(last, now, every=window != self._window)
        self._window = window
        self._last = snap
        if self.check:
            fresh = cluster_snapshot(models, self.devices, self.ledgers, loop, now)
            # the ledgers' bytes move while the workers map and unmap: not compared
            fresh = fresh.with_entries(
                {
                    d: replace(v, mapped_bytes=snap.devices[d].mapped_bytes) if d in snap.devices else v
                    for d, v in fresh.devices.items()
                },
                fresh.engines,
            )
            if not _same(snap, fresh):
                raise SnapshotMismatchError(_difference(snap, fresh))
        return snap

    def _fresh(self, now: float) -> ClusterSnapshot:
        self.models.changed.clear()
        self.loop.stale_models.clear()
        # inputs read before the snapshot is built, as in _updated: an entry that another thread
        # changes in between has reported itself, and its inputs read differently at the next build
        self._inputs = {n: _model_inputs(n, m, self.loop, now) for n, m in self.models.items()}
        snap = cluster_snapshot(self.models, self.devices, self.ledgers, self.loop, now)
        self._snaps = dict(snap.models)
        return snap

    def _updated(self, last: ClusterSnapshot, now: float, every: bool) -> ClusterSnapshot:
        """``last`` with the models that may have changed rebuilt (``every``: all may have, a new
        forecast window began), those whose inputs read as before kept as they were."""
        models, loop, snaps, inputs = self.models, self.loop, self._snaps, self._inputs
        resident = [n for n, m in models.items() if m.state is not ModelState.EVICTED]
        if every:
            stale = dict.fromkeys(models)
        else:
            stale = dict.fromkeys(models.changed)
            stale.update(loop.stale_models)
            stale.update((n, None) for n in loop.rates.moving(now))
            stale.update(dict.fromkeys(resident))
        models.changed.clear()
        loop.stale_models.clear()
        changed = []
        for name in stale:
            m = models.get(name)
            if m is None:
                continue
            seen = _model_inputs(name, m, loop, now)
            if inputs.get(name) == seen:
                continue
            inputs[name] = seen
            snap = _model_snapshot(name, m, loop, now)
            old = snaps.get(name)
            if old is None or snap != old:
                snaps[name] = snap
                changed.append(snap)
        engines = [_engine_snapshot(n, models[n]) for n in resident]
        now_engined = set(resident)
        gone = [n for n in last.engines if n not in now_engined]
        devices = _device_snapshots(models, resident, self.devices, self.ledgers, loop)
        return last.updated(changed, devices, engines, gone)


def _same(a: ClusterSnapshot, b: ClusterSnapshot) -> bool:
    return (
        list(a.models.items()) == list(b.models.items())
        and list(a.devices.items()) == list(b.devices.items())
        and dict(a.engines) == dict(b.engines)
    )


def _difference(a: ClusterSnapshot, b: ClusterSnapshot) -> str:
    """Where an incrementally built snapshot ``a`` differs from a fresh build ``b``."""
    out = []
    for kind in ("models", "devices", "engines"):
        x, y = getattr(a, kind), getattr(b, kind)
        if list(x) != list(y):
            out.append(f"{kind}: {list(x)} != {list(y)}")
        out += [f"{kind} {n}: {x[n]} != {y[n]}" for n in x if n in y and x[n] != y[n]]
    return "the snapshot built from what changed differs from a fresh build: " + "; ".join(out[:5])
