"""The discrete-event simulator: the body of control/loop.py's ControlLoop in simulated time.

The loop is ``pop the earliest event -> hand it to the control loop`` (arrival, tick, step done,
activation done). The control loop (shared with the live runtime) calls the policies and applies
their actions through this class's effect methods; what the simulator adds is the *effect*:

- ``activate``: weights are mapped on every device of the placement once they fit (until then the
  activation waits and its weights are claimed, so admission stops handing that memory to KV); the
  engine starts ``cost.activation_time`` later.
- ``evict``: the engine stops, its weights and KV are unmapped; requests it was running start over
  (the loop routes them again, keeping their arrival time). Queued requests stay queued.
- ``set_kv_quota``: the engine's KV cap per device (an allocation beyond it fails as if memory were
  full, like the ledger's per-engine limit).
- ``dispatch``: the request joins its engine's waiting queue; the engine's scheduler takes it at its
  next step boundary. ``reject`` ends the request as a miss.

Where the workload carries prompt block hashes (and ``SimConfig.engine.prefix_caching``), each engine
keeps a prefix cache (engine.py) keyed by ``workload.prefix.block_keys`` at the engine's block size;
an eviction empties it, but for its hottest keys, kept within ``SimConfig.kept_prefix_bytes`` and
restored at the model's next activation (as live: memory/kept.py). The result reports the prompt
tokens found cached, and what an unbounded cache per model would have held on the same requests
(``workload.prefix.infinite_cache_hits``).
Under a prefix-aware policy the control requests also carry the same hashes' keys at the control
plane's block size (``control.PREFIX_BLOCK_TOKENS``), as the live controller's carry its prompts':
the control loop routes replicas by the prefixes it sent each one and counts only the uncached
tokens in admission's prefill estimate (control/prefix_index.py), the same code as live.

Snapshots of this state for every policy call come from sim/snapshots.py, which rebuilds only
what changed.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping
from dataclasses import replace

import numpy as np

from prism_serve.control import (
    ClusterSnapshot,
    DeviceSnapshot,
    EngineSnapshot,
    ModelProfile,
    ModelState,
    RejectReason,
    Request,
    RequestQueue,
    get_policy,
)
from prism_serve.control.loop import ControlLoop
from prism_serve.control.policies import POLICIES
from prism_serve.control.types import (
    DEFAULT_ORIGIN,
    PREFIX_BLOCK_TOKENS,
    REPLICA_SEPARATOR,
    Origin,
    Priority,
    replica_name,
    split_kv_bytes,
)
from prism_serve.engine.kv_cache import KVGroups
from prism_serve.memory.kept import KeptBudget
from prism_serve.sim.config import ModelSLO, SimConfig
from prism_serve.sim.cost import COST_MODELS
from prism_serve.sim.engine import SimEngine, SimRequest
from prism_serve.sim.errors import SimConfigError, SimStateError
from prism_serve.sim.events import ActivationDone, Arrival, EventQueue, Place, StepDone, Tick
from prism_serve.sim.hardware import get_hardware
from prism_serve.sim.memory import SimDevice
from prism_serve.sim.metrics import SimResult
from prism_serve.sim.models import ServedModel
from prism_serve.sim.snapshots import SnapshotBuilder
from prism_serve.sim.state import SimModel
from prism_serve.workload.format import Workload
from prism_serve.workload.prefix import block_keys, infinite_cache_hits

__all__ = ["ModelSLO", "SimConfig", "Simulator", "simulate"]


class Simulator:
    """The body of control.loop.ControlLoop in simulated time: simulated engines, memory and events."""

    def __init__(
        self,
        models: list[ServedModel],
        workload: Workload,
        slos: Mapping[str, ModelSLO],
        config: SimConfig,
    ) -> None:
        names = [m.name for m in models]
        if len(set(names)) != len(names):
            raise SimConfigError("model names must be unique")
        if bad := [n for n in names if REPLICA_SEPARATOR in n]:
            raise SimConfigError(f"model names must not contain {REPLICA_SEPARATOR!r} (replica slots): {bad}")
        missing = set(workload.models) - set(names)
        if missing:
            raise SimConfigError(f"workload names models the deployment lacks: {sorted(missing)[:5]}")
        if set(names) - set(slos):
            raise SimConfigError(f"no SLO for {sorted(set(names) - set(slos))[:5]}")
        self.config = config
        self.hw = get_hardware(config.hardware)
        if config.step_scale != 1.0:
            self.hw = self.hw.slowed(config.step_scale)
        self.cost = COST_MODELS[config.cost_model](self.hw)
        self.workload = workload
        width = max(2, len(str(config.num_devices - 1)))
        # the devices and engines changed since the last cluster snapshot (sim/snapshots.py)
        self._changed_devices: dict[str, None] = {}
        self._changed_engines: dict[str, None] = {}
        self.devices = {
            name: SimDevice(name, self.hw.capacity_bytes, config.page_size, self._changed_devices)
            for name in (f"gpu{i:0{width}d}" for i in range(config.num_devices))
        }
        # models with a rank placed on each device; dicts, not sets, so iteration order is reproducible
        self.on_device: dict[str, dict[str, None]] = {d: {} for d in self.devices}
        self.num_busy: dict[str, int] = dict.fromkeys(self.devices, 0)  # engines with a step in flight
        self._share = self.hw.share_slowdown if config.compute_sharing else None
        # devices with a step or copy in flight, for the host-wide term (hardware.cross_slowdown)
        self._cross = config.compute_sharing and (
            self.hw.cross_interference > 0 or any(c > 0 for _, _, c in self.hw.decode_interference)
        )
        # the terms depend on the shape of the step in flight (hardware.interference): known once the
        # step is scheduled, so its factor is set after
        self._by_shape = config.compute_sharing and bool(self.hw.decode_interference)
        # ... and for the serving path's share once every device is busy (hardware.serving_slowdown)
        self._serving = config.compute_sharing and self.hw.serving_share > 0
        self._host_wide = self._cross or self._serving  # a device turning busy or idle moves everyone
        self._busy_devices = 0
        self._live_profiles = config.profiles == "live"
        # live profiles: models whose step sums moved since the last tick, when their snapshot
        # (their measured profile) is read again, as the tick's marks once read every model's
        self._stepped: dict[str, None] = {}
        knobs = dict(config.knobs)
        # what an operator would size a hand-provisioned policy for: each model's mean rate and
        # longest request
        policy_type = POLICIES[config.policy]
        provisioned = policy_type.provisioned_knobs(workload.mean_rates(), workload.longest_requests())
        for key, value in provisioned.items():
            knobs.setdefault(key, value)
        policy = get_policy(config.policy, **knobs)
        self.models: dict[str, SimModel] = {}
        self.replica_of: dict[str, str] = {}  # replica slot -> served model (control/replicas.py)
        for m in models:
            state = self._model_state(m, workload, slos[m.name])
            self.models[m.name] = state
            # replica slots beyond replica 0: the same model and costs under their own name
            for k in range(1, min(policy.replica_slots, config.num_devices // m.tp_size)):
                name = replica_name(m.name, k)
                self.models[name] = replace(state, served=replace(m, name=name), quota={})
                self.replica_of[name] = m.name
        self.loop = ControlLoop(
            policy,
            list(self.devices),
            self,
            self.models,
            0.0,
            rate_window_s=config.rate_window_s,
            place_later=self._place_later if config.placement_coalesce_s > 0 else None,
            rate_priors={m.name: m.expected_rate for m in models if m.expected_rate is not None},
        )
        # the coalesced placement after activations (Place): whether one is due, the last finish
        # it is for, and when the last tick ran (which places anyway)
        self._place_due = False
        self._place_for = -math.inf
        self._last_tick = -math.inf
        self._slots: dict[str, list[str]] = {}
        for name, base in self.replica_of.items():
            self._slots.setdefault(base, []).append(name)
        self.events = EventQueue()
        self.requests: list[SimRequest] = []
        self.by_id: dict[str, SimRequest] = {}
        self.pending_activations: list[str] = []
        self.counters: Counter = Counter()
        self._activation_s: dict[str, list[tuple[float, float]]] = {}  # SimResult.activation_s
        self._unmapping: dict[str, float] = {}  # per device, when the evictions under way end
        self.now = 0.0
        self.in_system = 0
        self._integral = 0.0
        self._busy = 0.0
        self._last_t = 0.0
        # the requests simulated (SimConfig.span): indices first..end - 1 of the workload
        self._first, self._end = config.span if config.span is not None else (0, len(workload))
        if not 0 <= self._first <= self._end <= len(workload):
            raise SimConfigError(f"span {config.span} is outside the workload's {len(workload)} requests")
        spanned = config.span is not None and self._first < len(workload)
        self._t0 = float(workload.timestamps[self._first]) if spanned else 0.0
        self._next_arrival = self._first
        self._names = workload.models
        # prefix caching: the workload's hashes, and the engines' block size its keys are made for
        self._hashes = workload.block_hashes if config.engine.prefix_caching else None
        # each (tenant, priority) of the workload as admission sees it (control/fairness.py)
        weights = dict(config.tenant_weights)
        self._origins = [
            Origin(tenant, Priority[priority.upper()], weights.get(tenant, 1.0))
            for tenant, priority in workload.origins or ()
        ]
        self._block_size = config.engine.block_size
        # an evicted model's hottest cached prefix keys with their hit counts, restored at its next
        # activation
        self._kept: KeptBudget[tuple[tuple[int, int], ...]] = KeptBudget(
            config.kept_prefix_bytes if self._hashes is not None else 0
        )
        # early stop (SimConfig.stop_after_ttft_misses): requests not yet known to meet or miss
        # their TTFT SLO, and those known to have missed it
        self._unsettled: list[SimRequest] = []
        self.ttft_misses = 0  # judgements missed: a group of inputs counts once (sim/metrics.py)
        self._missed_groups: set[int] = set()
        self.stopped_early = False
        # the other models each one was resident with on a device, at any time
        self.colocated: dict[str, set[str]] = {}
        self.snapshots = SnapshotBuilder(
            self.models, self.devices, self.on_device, self.loop, self.replica_of,
            live_profiles=config.profiles == "live", max_num_seqs=config.engine.max_num_seqs,
            changed_devices=self._changed_devices, changed_engines=self._changed_engines,
        )  # fmt: skip

    @property
    def queues(self) -> dict[str, RequestQueue]:
        return self.loop.queues

    def _model_state(self, m: ServedModel, workload: Workload, slo: ModelSLO) -> SimModel:
        mask = workload.model_index == workload.models.index(m.name) if m.name in workload.models else None
        n = int(mask.sum()) if mask is not None else 0
        prompt = float(workload.prompt_tokens[mask].mean()) if n else 512.0
        output = float(workload.output_tokens[mask].mean()) if n else 256.0
        speed = self.cost.prefill_tokens_per_s(m.spec, m.tp_size, int(prompt))
        batch = 16  # a typical decode batch for the muxserve estimator's per-request step time
        step = float(
            self.cost.decode_steps(m.spec, m.tp_size, batch, int(batch * (prompt + output / 2)), 1)[0]
        )
        engine = self.config.engine
        groups = KVGroups.of(m.spec.config, engine.resolve_max_model_len(m.spec.config), engine.windowed_kv)
        per_token = -(-m.spec.engine_kv_bytes_per_token // m.tp_size)
        kv_split = groups.kv_split(per_token, engine.max_num_batched_tokens, engine.block_size)
        profile = ModelProfile(
            prompt, output, speed, step, max_rate=self._max_rate(m, slo, prompt, output, speed, kv_split)
        )
        return SimModel(m, slo, profile, speed, kv_groups=groups)

    def _max_rate(
        self,
        m: ServedModel,
        slo: ModelSLO,
        prompt: float,
        output: float,
        speed: float,
        kv_split: tuple[int, tuple[int, int] | None],
    ) -> float:
        """Requests/s one replica of ``m`` serves alone on its devices within its SLOs, from the cost
        model: the smaller of

        - the decode bound: the largest decode batch ``B`` (at most ``max_num_seqs``, its KV by
          ``kv_split`` within the memory its weights leave) whose step at the mean context takes
          at most ``tpot_s``, each request's prefill taking the whole engine:
          ``1 / (p + output * step(B) / B)`` with ``p = prompt / prefill_speed``;
        - the TTFT bound: prefills queue for the engine one after another, so the load ``rho = rate * p``
          must keep the queueing delay's tail within the SLO's slack. With the M/D/1 mean wait
          ``rho p / (2 (1 - rho))`` and an exponential tail (p99 = 4.6 x the mean):
          ``4.6 rho p / (2 (1 - rho)) <= ttft_s - p``.
        """
        c = self.config
        kv_room = self.hw.capacity_bytes - m.spec.weight_bytes / m.tp_size
        kv_per_request = split_kv_bytes(kv_split, prompt + output)
        top = max(1, min(c.engine.max_num_seqs, int(kv_room // max(1.0, kv_per_request))))

        def step(b: int) -> float:
            return float(self.cost.decode_steps(m.spec, m.tp_size, b, int(b * (prompt + output / 2)), 1)[0])

        lo, hi = 1, top
        while lo < hi:  # the step time grows with the batch: the largest B within the SLO
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if step(mid) <= slo.tpot_s else (lo, mid - 1)
        p = prompt / speed
        decode_bound = 1.0 / (p + output * step(lo) / lo)
        slack = 2.0 * max(0.0, slo.ttft_s - p) / (4.6 * p)
        rho = max(0.05, slack / (1.0 + slack))  # a prefill longer than the SLO still gets a trickle
        return min(decode_bound, rho / p)

    # -- the event loop --------------------------------------------------------------------------------

    def run(self) -> SimResult:
        first, end = self._first, self._end
        if end > first:
            self.events.push(self._arrival_time(first), Arrival(first))
        self.events.push(0.0, Tick())
        stop = self._arrival_time(end - 1) + self.config.drain_s if end > first else 0.0
        while self.events:
            t, event = self.events.pop()
            if t > stop:
                break
            self._advance(t)
            self.snapshots.seal()  # the last cluster snapshot shows the state before this event
            event.apply(self, t)
            if self.in_system == 0 and self._next_arrival >= end:
                break
            if self.stopped_early:
                break
        self._advance(min(self.now, stop))
        labels = {
            "policy": self.config.policy,
            "hardware": self.hw.label,
            "num_devices": self.config.num_devices,
            "compute_sharing": self.config.compute_sharing,
            "step_scale": self.config.step_scale,
            "simulated": True,
            "stopped_early": self.stopped_early,
        }
        counters = self.counters + self.loop.counters
        colocated = {m: sorted(others) for m, others in self.colocated.items()}
        infinite: dict[str, int] = {}
        if self._hashes is not None:
            labels["prefix_caching"] = True
            span = np.zeros(len(self.workload), dtype=bool)
            span[first : self._next_arrival] = True  # the requests that arrived (a run may stop early)
            simulated = self.workload.select(span)
            hits = infinite_cache_hits(simulated, self._block_size)
            for m, h in zip(simulated.model_index.tolist(), hits.tolist(), strict=True):
                name = self._names[m]
                infinite[name] = infinite.get(name, 0) + h
        return SimResult(
            self.requests,
            self.now,
            self._busy,
            self._integral,
            counters,
            labels,
            colocated,
            infinite,
            activation_s=self._activation_s,
        )

    def _arrival_time(self, i: int) -> float:
        return self.config.warmup_s + float(self.workload.timestamps[i]) - self._t0

    def _advance(self, t: float) -> None:
        dt = t - self._last_t
        if dt > 0:
            self._integral += self.in_system * dt
            if self.in_system:
                self._busy += dt
        self._last_t = t
        self.now = t

    # -- events: each one is handed to the control loop ----------------------------------------------

    def on_arrival(self, i: int, now: float) -> None:
        wl = self.workload
        model = self._names[wl.model_index[i]]
        m = self.models[model]
        prompt, output = int(wl.prompt_tokens[i]), int(wl.output_tokens[i])
        req_id = str(i)
        keys = prefix_keys = ()
        if self._hashes is not None:
            keys = block_keys(self._hashes[i], wl.block_tokens, prompt, self._block_size)
            if self.loop.prefix_aware:  # the control plane's keys, at its own block size
                step, rest = divmod(PREFIX_BLOCK_TOKENS, self._block_size)
                # a chained key names the whole prefix up to its block's end: where the engine's
                # blocks tile the control plane's, its keys at their ends are the control keys
                prefix_keys = (
                    keys[step - 1 :: step]
                    if step and not rest
                    else block_keys(self._hashes[i], wl.block_tokens, prompt, PREFIX_BLOCK_TOKENS)
                )
        ttft_slo, tpot_slo, origin = m.slo.ttft_s, m.slo.tpot_s, DEFAULT_ORIGIN
        if self._origins:
            origin = self._origins[wl.origin_index[i]]
            if origin.priority is Priority.BATCH:  # its batch's window: attainment leaves it out
                ttft_slo, tpot_slo = self.config.batch_window_s, math.inf
        control = Request(req_id, model, now, prompt, ttft_slo, prefix_keys, origin=origin)
        req = SimRequest(req_id, model, now, prompt, output, ttft_slo, tpot_slo, control)
        req.block_keys = keys
        if wl.groups is not None:
            req.group = int(wl.groups[i])
        # cold: no replica of the model had a ready engine when the request arrived
        req.cold = all(self.models[name].state is not ModelState.ACTIVE for name in self._replicas_of(model))
        self.requests.append(req)
        self.by_id[req_id] = req
        self.in_system += 1
        if (
            self.config.stop_after_ttft_misses is not None
            and i >= self.config.count_from
            and origin.priority is not Priority.BATCH  # not judged (metrics.attainment)
        ):
            self._unsettled.append(req)
        self._next_arrival = i + 1
        if i + 1 < self._end:
            self.events.push(self._arrival_time(i + 1), Arrival(i + 1))
        self.loop.arrival(control, now)

    def _count_ttft_misses(self, now: float) -> None:
        """Settle every request whose TTFT outcome is known by ``now`` (a first token, a rejection,
        or a wait already past its SLO) and stop the run once the misses pass the limit."""
        still = []
        for r in self._unsettled:
            if r.first_token is not None:
                missed = r.first_token - r.arrival > r.ttft_slo
            elif r.rejected is not None or now - r.arrival > r.ttft_slo:
                missed = True
            else:
                still.append(r)
                continue
            if missed and r.group >= 0:  # its group misses once, whichever input missed first
                missed = r.group not in self._missed_groups
                self._missed_groups.add(r.group)
            self.ttft_misses += missed
        self._unsettled = still
        limit = self.config.stop_after_ttft_misses
        if limit is not None and self.ttft_misses > limit:
            self.stopped_early = True

    def _replicas_of(self, model: str) -> list[str]:
        """``model`` and its replica slots."""
        return [model, *self._slots.get(model, ())]

    def on_tick(self, now: float) -> None:
        self._last_tick = now
        if self.config.stop_after_ttft_misses is not None:
            self._count_ttft_misses(now)
        if self._stepped:
            self.loop.stale_models.update(self._stepped)
            self._stepped.clear()
        self.loop.tick(now)
        if self._next_arrival < self._end or self.in_system:
            self.events.push(now + self.config.tick_s, Tick())

    def _place_later(self) -> None:
        """The loop's ``place_later``: one placement ``placement_coalesce_s`` after the first of the
        activations that finish meanwhile."""
        self._place_for = self.now
        if not self._place_due:
            self._place_due = True
            self.events.push(self.now + self.config.placement_coalesce_s, Place())

    def on_place(self, now: float) -> None:
        self._place_due = False
        if self._last_tick < self._place_for:  # else a tick since the last finish placed knowing it
            self.loop.place(now)

    def on_step_done(self, model: str, version: int, now: float) -> None:
        m = self.models[model]
        e = m.engine
        if e is None or not e.busy or e.version != version:
            return  # the step was cut short or the engine stopped
        batch, steps, alone = e.decode_shape
        work = e.work_alone
        finished, freed = e.finish_step(now)  # not busy: _start below syncs the device's busy count
        if m.step_started is not None:
            m.step_seconds += now - m.step_started
            m.busy_seconds += work
            m.step_started = None
            if self._live_profiles:  # only what the live controller would measure reads the sums
                if steps:  # decode steps, timed alone: what StepSums fits (the live worker: CPU time)
                    m.steps = m.steps.plus(batch, alone, steps)
                self._stepped[m.served.name] = None
        for req in e.first_tokens:
            self.loop.first_token(req.req_id, req.first_token)
        m.num_served += len(finished)
        for req in finished:
            self._leave(req)
            m.num_running -= 1
            self.loop.request_left(req.req_id, req.output_tokens, now, req.first_token)
        if finished:
            self.loop.stale_models[m.served.name] = None
        self._start(e, now)
        if freed:
            self._memory_freed(e.devices, now)
        if finished or freed:
            self.loop.capacity_freed([d.name for d in e.devices], now)

    def on_activation_done(self, model: str, version: int, now: float) -> None:
        m = self.models[model]
        if m.activation_version != version or m.state is not ModelState.ACTIVATING:
            return
        self._copy_done(m, now)
        devices = [self.devices[d] for d in m.placement]
        quota = m.quota.get(m.placement[0])
        c = self.config
        budget = c.engine.max_num_batched_tokens
        arch = m.served.spec.config
        if arch.encoder:  # a step holds the longest input whole (the live engine's budget)
            budget = max(budget, c.engine.resolve_max_model_len(arch))
        m.engine = SimEngine(
            m.served,
            devices,
            self.cost,
            block_size=c.engine.block_size,
            max_num_seqs=c.engine.max_num_seqs,
            max_num_batched_tokens=budget,
            max_run_steps=c.max_run_steps,
            quota=quota,
            changed=self._changed_engines,
            prefix_caching=self._hashes is not None,
            kv_groups=m.kv_groups,
        )
        kept = self._kept.take(model)
        if kept is not None and m.engine.cache is not None:  # restored before it serves
            restored = m.engine.cache.adopt(kept[: m.engine.cache_room()])
            self.counters["restored_prefix_blocks"] += restored
        m.state = ModelState.ACTIVE
        m.activated_at = now
        self.loop.stale_models[m.served.name] = None
        self.counters["activations"] += 1
        took = (m.placed_at, now - m.placed_at)
        self._activation_s.setdefault(self.replica_of.get(model, model), []).append(took)
        if model in self.replica_of:
            self.counters["replica_activations"] += 1
        self.loop.activation_done(model, m.placement[0], now)

    def _leave(self, req: SimRequest) -> None:
        self.in_system -= 1

    # -- effects (the control loop's Body) -----------------------------------------------------------

    def model_state(self, model: str) -> tuple[ModelState, int]:
        m = self.models[model]
        return m.state, m.num_running

    def dispatch(self, request: Request, device: str, now: float) -> bool:
        self.snapshots.seal()
        req = self.by_id[request.req_id]
        m = self.models[request.model]  # the replica the loop routed it to
        e = m.engine
        if e is None or m.placement[0] != device:
            raise SimStateError(f"dispatch of {req.req_id} to {device}, where {request.model} has no engine")
        m.num_running += 1
        req.replica = request.model
        self.loop.stale_models[m.served.name] = None
        e.add(req)
        if e.busy:
            end = e.cut(now)
            if end is not None:
                self.events.push(end, StepDone(e.name, e.version))
        else:
            self._start(e, now)
        return True

    def reject(self, request: Request, reason: RejectReason, detail: str, now: float) -> None:
        self.snapshots.seal()
        req = self.by_id[request.req_id]
        req.rejected = reason.value
        self._leave(req)

    def set_kv_quota(self, model: str, device: str, quota_bytes: int | None) -> None:
        self.snapshots.seal()
        m = self.models[model]
        m.quota[device] = quota_bytes
        if m.engine is not None and m.placement and m.placement[0] == device:
            m.engine.set_quota(quota_bytes)

    def _start(self, e: SimEngine, now: float) -> None:
        factor = 1.0 if self._share is None or self._by_shape else self._slowdown(e, joining=True)
        end = e.start_step(now, factor)
        if end is not None and self._by_shape:  # its terms by the shape just scheduled
            shared = e.rescale(now, self._slowdown(e, joining=True))
            end = end if shared is None else shared
        if end is not None:
            self.events.push(end, StepDone(e.name, e.version))
            self.models[e.name].step_started = now
        self._sync_busy(e, now)

    # -- compute sharing -----------------------------------------------------------------------------

    def _slowdown(self, e: SimEngine, *, joining: bool = False) -> float:
        """How much slower than alone ``e`` steps: by its most loaded device's busy engines, itself
        included (``joining``: about to start a step, not counted yet)."""
        extra = 1 if joining and not e.shared else 0
        rows = e.decode_shape[0] if self._by_shape else 0  # 0: a step with a prefill chunk
        factor = self._share(max(self.num_busy[d.name] for d in e.devices) + extra, rows)
        if self._host_wide:
            # the other devices with work: the memory system they share with e's, and no core left
            # idle for the serving path once they are all of them
            others = self._busy_devices - sum(1 for d in e.devices if self.num_busy[d.name] > 0)
            if self._cross:
                factor *= self.hw.cross_slowdown(others, rows)
            if self._serving:
                factor *= self.hw.serving_slowdown(others + len(e.devices) >= len(self.devices))
        return factor

    def _sync_busy(self, e: SimEngine, now: float) -> None:
        """Count ``e`` among its devices' busy engines if it has a step in flight; when a device's
        count changes, every other busy engine there goes on at the new speed (processor sharing:
        hardware.share_slowdown; exact for the step in flight, not just the next one)."""
        if self._share is None or e.busy == e.shared:
            return
        e.shared = e.busy
        self._device_busy([d.name for d in e.devices], 1 if e.busy else -1, now, e)

    def _device_busy(self, devices, delta: int, now: float, joined: SimEngine | None = None) -> None:
        """``delta`` more busy sharers on ``devices``: every busy engine there other than ``joined``
        goes on at the new speed; when a device starts or stops having work and devices share the
        host's memory system (hardware.cross_interference) or its serving path takes their cores
        once all are busy (hardware.serving_share), every busy engine does."""
        was = self._busy_devices
        for d in devices:
            before = self.num_busy[d] > 0
            self.num_busy[d] += delta
            self._busy_devices += (self.num_busy[d] > 0) - before
        if self._host_wide and self._busy_devices != was:
            devices = self.devices
        for d in devices:
            for name in self.on_device[d]:
                other = self.models[name].engine
                if other is None or other is joined or not other.busy:
                    continue
                end = other.rescale(now, self._slowdown(other))
                if end is not None:
                    self.events.push(end, StepDone(other.name, other.version))

    def _copy_done(self, m: SimModel, now: float) -> None:
        """An activation's copy that counted as busy on its devices ended (done or cancelled)."""
        if m.copying:
            self._device_busy(m.placement, -m.copying, now)
            m.copying = 0

    def activate(self, model: str, devices: tuple[str, ...], now: float) -> None:
        self.snapshots.seal()
        m = self.models[model]
        if m.state is not ModelState.EVICTED:
            raise SimStateError(f"activate {model}: it is {m.state.value} on {m.placement}")
        if len(devices) != m.served.tp_size:
            raise SimStateError(f"activate {model} on {devices}: tp_size is {m.served.tp_size}")
        m.state = ModelState.ACTIVATING
        m.placement = tuple(devices)
        m.placed_at = now
        m.activation_version += 1
        self.loop.stale_models[m.served.name] = None
        base = self.replica_of.get(model, model)
        for d in devices:
            for other in self.on_device[d]:
                other = self.replica_of.get(other, other)
                if other != base:
                    self.colocated.setdefault(base, set()).add(other)
                    self.colocated.setdefault(other, set()).add(base)
            self.on_device[d][model] = None
            self.devices[d].touch()
        self.pending_activations.append(model)
        self._try_pending(now)

    def _try_pending(self, now: float) -> None:
        still = []
        for model in self.pending_activations:
            m = self.models[model]
            part = -(-m.served.spec.weight_bytes // m.served.tp_size)
            devs = [self.devices[d] for d in m.placement]
            key = f"{model}#weights"
            if all(d.pages_for(part) <= d.free_pages for d in devs):
                for d in devs:
                    d.claim(key, 0)
                    d.map_weights(model, part)
                m.pending = False
                around, copy = self.cost.activation_parts(m.served.spec, m.served.tp_size)
                # its kept prefixes come back over the same link
                copy += self._kept.size_of(model) / (self.hw.host_bandwidth * self.hw.host_efficiency)
                took = around + copy
                k = self.hw.activation_threads
                if self._share is not None and k:
                    # the copy's k threads share the cores with the engines stepping there, as
                    # does the one worker thread around it (for as long as the count at its start
                    # says: it is short), and they with it
                    busy = max(self.num_busy[d] for d in m.placement)
                    took = around * (busy + 1) + copy * (busy + k) / k
                    m.copying = k
                    self._device_busy(m.placement, k, now)
                # an eviction still under way on its devices goes first (HardwareProfile.eviction_for)
                took += max(0.0, max(self._unmapping.get(d, 0.0) for d in m.placement) - now)
                self.events.push(now + took, ActivationDone(model, m.activation_version))
            else:
                for d in devs:
                    d.claim(key, part)
                m.pending = True
                still.append(model)
        self.pending_activations = still

    def evict(self, model: str, now: float) -> list[Request]:
        """Stop the engine and unmap the model; the requests it was running start over."""
        self.snapshots.seal()
        m = self.models[model]
        if m.state is ModelState.EVICTED:
            raise SimStateError(f"evict {model}: not resident")
        restarted = []
        if m.engine is not None:
            self._keep_prefixes(model, m.engine, m.served.tp_size)
            restarted = m.engine.drop_all()
            self._sync_busy(m.engine, now)
        devs = [self.devices[d] for d in m.placement]
        if m.state is ModelState.ACTIVE:  # its engine stops and its pages go before the next activation
            until = now + self.hw.eviction_for(m.served.spec.name)
            for d in m.placement:
                self._unmapping[d] = max(self._unmapping.get(d, 0.0), until)
        for d in devs:
            d.unmap_weights(model)
            d.claim(f"{model}#weights", 0)
            self.on_device[d.name].pop(model, None)
            d.touch()
        if model in self.pending_activations:
            self.pending_activations.remove(model)
        self._copy_done(m, now)
        m.engine = None
        m.state = ModelState.EVICTED
        m.placement = ()
        m.placed_at = None
        m.pending = False
        m.activation_version += 1
        self.loop.stale_models[m.served.name] = None
        for req in restarted:
            m.num_running -= 1
            req.num_restarts += 1
        self._memory_freed(devs, now)
        self.loop.wake(d.name for d in devs)
        return [req.control for req in restarted]

    def _keep_prefixes(self, model: str, engine: SimEngine, tp: int) -> None:
        """As the live worker does at an eviction: the engine's hottest cached blocks, within what
        the kept-prefix budget allows (memory/kept.py), kept for the model's next activation."""
        if engine.cache is None or tp != 1 or not self._kept.budget_bytes:
            return
        allowance, _ = self._kept.room(model)
        keys = engine.cache.hottest(allowance // engine.cached_block_bytes)
        if keys:
            self._kept.keep(model, tuple(keys), len(keys) * engine.cached_block_bytes)

    def _memory_freed(self, devs: list[SimDevice], now: float) -> None:
        """Activations waiting for memory and engines waiting for blocks may go on."""
        if self.pending_activations:
            self._try_pending(now)
        for d in devs:
            for name in self.on_device[d.name]:
                e = self.models[name].engine
                if e is None or not e.waiting:
                    continue
                if not e.busy:
                    self._start(e, now)
                else:
                    end = e.cut(now)
                    if end is not None:
                        self.events.push(end, StepDone(e.name, e.version))

    # -- snapshots (the control loop's view of this state: sim/snapshots.py) ---------------------------

    def admission_view(self, device: str, now: float) -> tuple[DeviceSnapshot, dict[str, EngineSnapshot]]:
        return self.snapshots.admission_view(device, now)

    def cluster(self, now: float) -> ClusterSnapshot:
        return self.snapshots.cluster(now)


def simulate(
    models: list[ServedModel], workload: Workload, slos: Mapping[str, ModelSLO], config: SimConfig
) -> SimResult:
    """Run one simulation to the end (every request finished, or ``drain_s`` after the last arrival)."""
    if any(m.tp_size > config.num_devices for m in models):
        raise SimConfigError(f"a model's tp_size exceeds the {config.num_devices} devices")
    if not all(math.isfinite(s.ttft_s) and s.ttft_s > 0 for s in slos.values()):
        raise SimConfigError("SLOs must be finite and > 0")
    return Simulator(models, workload, slos, config).run()
