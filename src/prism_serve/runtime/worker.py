"""A worker: one pre-started engine process on one device, serving at most one model at a time.

At start-up it pins itself to its device's cores, imports torch, connects to the controller and
reserves two virtual ranges (weights, KV) of the device's size; then it holds no model and waits.
While it waits it works through the controller's ``Prepare``: it builds the engine shapes it names
(vLLM's engine), maps the host cache files (pre-faulted in pieces of ``PREFAULT_CHUNK_BYTES``) and
parses the tokenizers, one piece between two polls of its socket, so that an activation finds them
open. ``ActivateModel`` opens the model's host cache file and two ledger accounts (weights, KV) and
hands them to the worker's engine slot (runtime/engine_slot.py: built-in or vLLM), which puts the
weights on the device and builds the engine; the worker then serves. ``EvictModel`` makes the slot
give back every page of the model and leaves the worker idle in the pool again, ranges still
reserved. The worker drives any engine only through engine/interface.py.

The loop: drain control messages, run one engine step, send that step's tokens. Run as
``python -m prism_serve.runtime.worker --worker-id ... --device cpu:0 --endpoint ipc://...``.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import zmq

from prism_serve.control.profiles import StepSums
from prism_serve.engine.cpu_kernels import kernels_enabled
from prism_serve.engine.interface import WorkerEngine, WorkerKV
from prism_serve.engine.sequence import RequestMetrics
from prism_serve.engine.step_trace import StepRecord, StepTrace
from prism_serve.engine.tensor_parallel import follow
from prism_serve.engine.tokenizer import Tokenizer
from prism_serve.errors import InvalidRequestError, ModelEvictedError, PrismError, WorkerDiedError
from prism_serve.memory.ledger import Account, DeviceLedger
from prism_serve.memory.spare import SparePages, spare_entry
from prism_serve.memory.vmm import DEFAULT_PAGE_SIZE, reserve
from prism_serve.runtime import messages as msg
from prism_serve.runtime.adapters import MappedAdapters
from prism_serve.runtime.builtin_slot import BuiltinSlot
from prism_serve.runtime.devices import DeviceSpec, parse_cores, pin_process
from prism_serve.runtime.engine_slot import EngineSlot, Loaded
from prism_serve.runtime.loading import LOAD_THREADS
from prism_serve.runtime.vllm_slot import VllmSlot
from prism_serve.runtime.weight_cache import PREFAULT_CHUNK_BYTES, SharedWeights

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_IDLE_POLL_MS = 200
_STALLED_POLL_MS = 5  # the ledger refused KV blocks: retry soon, without spinning
# an idle engine holding cached KV blocks looks this often whether the device wants them back
_CACHE_POLL_MS = 20
# an idle tensor parallel rank 0 tells the others it is alive this often (their wait for its next
# step times out after engine/tensor_parallel.GROUP_TIMEOUT_S)
_HEARTBEAT_S = 1.0


@dataclass(slots=True)
class _Active:
    model: str
    loaded: Loaded  # its engine and KV memory, as its slot activated them
    weight_account: Account
    kv_account: Account
    weight_bytes: int
    prefill_tokens_per_s: float | None = None
    step_seconds: float = 0.0  # wall time spent in engine steps since the activation
    # the same steps timed by this process's CPU, each at most its wall time: what they cost alone
    # (on a shared core a step's wall time also holds the slices its neighbours ran in)
    busy_seconds: float = 0.0
    decode: StepSums = field(default_factory=StepSums)  # decode steps since the activation, CPU-timed
    cpu_start: float = 0.0  # this process's CPU time when the activation finished
    synced_at: float = 0.0  # a tensor parallel rank 0: when the other ranks last heard from it
    fingerprint: str = ""  # what its KV is computed with, as kept prefix files name it

    @property
    def engine(self) -> WorkerEngine:
        return self.loaded.engine

    @property
    def pool(self) -> WorkerKV:
        return self.loaded.kv


class Worker:
    def __init__(
        self,
        worker_id: str,
        device: DeviceSpec,
        endpoint: str,
        reserve_bytes: int,
        namespace: str | None = None,
        page_size: int = DEFAULT_PAGE_SIZE,
        load_threads: int = LOAD_THREADS,
        spare_bytes: int = 0,
        engine: str = "builtin",
    ) -> None:
        start = time.monotonic()
        self.worker_id = worker_id
        self.device = device
        pin_process(device)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.IDENTITY, worker_id.encode())
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(endpoint)
        self.decoder = msg.to_worker_decoder()
        self.ledger = DeviceLedger(device.name, device.memory_bytes, namespace)
        self.weight_range = reserve(device.name, reserve_bytes, page_size)
        self.kv_range = reserve(device.name, reserve_bytes, page_size)
        # weight pages kept mapped between models and made ahead of time (0: off)
        self.spare = SparePages(
            self.weight_range, self.ledger, spare_entry(worker_id), target_bytes=spare_bytes
        )
        self.loader = ThreadPoolExecutor(load_threads, thread_name_prefix="prism-load")
        self.load_threads = load_threads
        self.shared: dict[str, SharedWeights] = {}  # host cache files this worker has mapped
        self.tokenizers: dict[str, Tokenizer] = {}  # by tokenizer file
        # LoRA adapters over their host cache files, mapped once: registered at each activation
        self.adapter_files = MappedAdapters()
        self.to_prepare: deque[msg.CacheFile | str] = deque()  # Prepare's items not yet opened
        self.prepare_s = 0.0
        self.active: _Active | None = None
        self.trace = StepTrace.from_env(worker_id)  # PRISM_STEP_TRACE: every step's shape and time
        # what runs models here, and keeps what it keeps between them (runtime/engine_slot.py)
        self.slot: EngineSlot
        w, kv = self.weight_range, self.kv_range
        if engine == VllmSlot.kind:
            self.slot = VllmSlot(device, w, kv, self.loader, self.ledger, worker_id)
        else:
            self.slot = BuiltinSlot(device, w, kv, self.spare, self.loader, namespace, self.trace is not None)
            if device.name.startswith("cpu"):
                # the engine's CPU kernels, loaded (built once per machine, ~1 s) before this worker
                # is ready rather than on its first model's first step
                kernels_enabled()
        self.running = True
        self._send(
            msg.WorkerReady(worker_id, os.getpid(), device.name, reserve_bytes, time.monotonic() - start)
        )

    # ---- loop ---------------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while self.running:
                if self.active is not None and self.active.loaded.rank > 0:
                    self._follow(self.active)  # until rank 0 closes, or the group breaks
                    continue
                engine = self.active.engine if self.active else None
                busy = engine is not None and engine.has_unfinished_requests()
                idle_poll = (
                    _CACHE_POLL_MS if engine is not None and engine.num_cached_blocks else _IDLE_POLL_MS
                )
                timeout = (_STALLED_POLL_MS if engine.stalled else 0) if busy else idle_poll
                preparing = bool(self.to_prepare) and self.active is None
                if self.sock.poll(0 if preparing else timeout):
                    self._drain()
                elif preparing:
                    self._prepare_one()
                a = self.active
                if a is not None and a.engine.has_unfinished_requests():
                    self._in_group(a, self._step)
                elif a is not None and a.loaded.world > 1 and time.monotonic() - a.synced_at > _HEARTBEAT_S:
                    self._in_group(a, lambda a: a.engine.heartbeat())
                self.slot.poll()
        finally:
            self.close()

    # ---- tensor parallel ranks (engine/tensor_parallel.py) --------------------------------------

    def _in_group(self, a: _Active, work: Callable[[_Active], object]) -> None:
        """Run ``work`` (a step, or rank 0's heartbeat); a tensor parallel model whose group broke
        meanwhile (another rank died: the collectives raise) is lost."""
        if a.loaded.world == 1:
            work(a)
            return
        try:
            work(a)
        except Exception as e:
            self._group_lost(a, e)
            return
        a.synced_at = time.monotonic()

    def _follow(self, a: _Active) -> None:
        """A rank other than 0: run rank 0's steps until it closes (its model was evicted: the
        controller's EvictModel follows) or the group breaks."""
        try:
            follow(a.engine)
        except Exception as e:
            self._group_lost(a, e)
            return
        self._release(a)

    def _group_lost(self, a: _Active, e: Exception) -> None:
        """Another rank of the model died: fail the requests this rank holds (rank 0 holds them
        all) with 503, give back every page, and tell the controller."""
        logger.warning("the tensor parallel group of %s broke: %s", a.model, e)
        a.engine.lost = True
        why = f"a rank of tensor parallel model {a.model} died ({type(e).__name__})"
        for req_id in a.engine.abort_all() if a.loaded.rank == 0 else []:
            self._fail(req_id, WorkerDiedError(why))
        self._release(a)
        self._send(msg.ModelLost(a.model, why))

    def _drain(self) -> None:
        while self.running:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            self._handle(self.decoder.decode(frame))

    def _handle(self, m: msg.ToWorker) -> None:
        match m:
            case msg.AddRequest():
                self._add_request(m)
            case msg.AbortRequest():
                if self.active is not None and self.active.engine.abort_request(m.req_id):
                    if not self.active.engine.has_unfinished_requests():
                        self.active.pool.shrink_buffer()
                    self._send(msg.StepOutputs([], self._stats(self.active)))  # its KV is free now
            case msg.Prepare():
                self.to_prepare.extend([*m.engines, *m.files, *m.tokenizers])
                if not self.to_prepare:
                    self._send(msg.Prepared([], [], 0.0, self.slot.built()))
            case msg.ActivateModel():
                self._activate(m)
            case msg.EvictModel():
                self._evict(m)
            case msg.SetKVLimit():
                if self.active is not None:
                    self.active.pool.set_limit(m.limit_bytes)
            case msg.LoadAdapter():
                if self.active is not None:
                    self._register_adapter(self.active, m.adapter)
            case msg.UnloadAdapter():
                a = self.active
                if a is not None and a.engine.adapters is not None and m.name in a.engine.adapters.adapters:
                    a.engine.remove_lora(m.name, force=True)
                    self._send(msg.StepOutputs([], self._stats(a)))  # its requests' KV is free
                self.adapter_files.forget(m.name)
            case msg.Shutdown():
                self.running = False

    def _send(self, m: msg.Message) -> None:
        self.sock.send(msg.encode(m))

    def _fail(self, req_id: str, e: BaseException) -> None:
        name = type(e).__name__ if isinstance(e, PrismError) else "PrismError"
        self._send(msg.RequestFailed(req_id, name, str(e)))

    # ---- ahead of activations ------------------------------------------------------------------

    def _prepare_one(self) -> None:
        """Open the next item of the Prepare; after the last, report what is open."""
        item = self.to_prepare.popleft()
        start = time.monotonic()
        try:
            if isinstance(item, msg.EngineShape):
                self.slot.build_ahead(item)
            elif isinstance(item, msg.CacheFile):
                shared = self._shared(item.path, item.size, populate=False)
                if not shared.prefault(PREFAULT_CHUNK_BYTES):
                    self.to_prepare.appendleft(item)  # the rest of it after the next poll
                else:
                    self._pin(shared)
            else:
                self._tokenizer(item)
        except Exception as e:  # a file dropped meanwhile: the activation that needs it says so
            logger.warning("preparing %s failed: %s", item, e)
        self.prepare_s += time.monotonic() - start
        if not self.to_prepare:
            files = sorted(path for path, f in self.shared.items() if f.complete)
            self._send(msg.Prepared(files, sorted(self.tokenizers), self.prepare_s, self.slot.built()))

    def _shared(self, path: str, size: int, populate: bool = True) -> SharedWeights:
        """A host cache file mapped once per worker (pre-faulted at once with ``populate``, else
        by ``prefault``)."""
        shared = self.shared.get(path)
        if shared is None:
            shared = self.shared[path] = SharedWeights(path, size, populate)
        return shared

    def _pin(self, shared: SharedWeights) -> None:
        """On a GPU, page-lock a complete cache file (once): each chunk's copy is then one DMA at
        the link's speed. Done when a Prepare finishes the file, else at its first activation."""
        if self.device.is_cuda and shared.complete and not shared.pinned:
            shared.pin()

    def _tokenizer(self, path: str) -> Tokenizer:
        tokenizer = self.tokenizers.get(path)
        if tokenizer is None:
            with open(path) as f:
                tokenizer = self.tokenizers[path] = Tokenizer.from_state(json.load(f))
        return tokenizer

    # ---- requests -----------------------------------------------------------------------------

    def _add_request(self, m: msg.AddRequest) -> None:
        if self.active is None:
            self._fail(m.req_id, InvalidRequestError(f"worker {self.worker_id} serves no model"))
            return
        try:
            self.active.engine.add_request(m.prompt_token_ids, m.params, m.req_id, m.adapter)
        except PrismError as e:
            self._fail(m.req_id, e)

    def _register_adapter(self, a: _Active, f: msg.AdapterFile) -> None:
        """Register a LoRA adapter in the active engine, its files read once per worker."""
        engine = a.engine
        if engine.adapters is None or f.name in engine.adapters.adapters:
            return
        try:
            engine.register_adapter(f.name, f.path, partial(self.adapter_files.get, f))
        except Exception as e:  # checked by the controller when it was loaded: the files changed since
            # (its requests then fail with a 400 naming it; the model and its other adapters serve on)
            logger.warning("adapter %s of %s not registered: %s", f.name, a.model, e)

    def _step(self, a: _Active) -> None:
        t0, c0, p0 = time.monotonic(), time.thread_time(), time.process_time()
        outs = a.engine.step()
        dt = time.monotonic() - t0
        # timed by this process's CPU (a colocated engine's share of the core is not this model's
        # cost), at most its wall time (several threads each use CPU time)
        alone = min(dt, time.process_time() - p0)
        a.step_seconds += dt
        a.busy_seconds += alone
        seqs = a.engine.last_step_seqs
        if seqs and a.engine.last_step_tokens == seqs:  # a decode step: the batching fit's sample
            a.decode = a.decode.plus(seqs, alone)
        if self.trace is not None and self.slot.traces_steps and a.engine.last_step_tokens:
            cpu = time.thread_time() - c0
            self.trace.write(StepRecord(a.model, time.time() - dt, dt, cpu, a.engine.last_step_batch))
        if a.engine.last_step_tokens >= 64 and dt > 0:  # mostly prefill: a usable speed sample
            speed = a.engine.last_step_tokens / dt
            a.prefill_tokens_per_s = (
                speed if a.prefill_tokens_per_s is None else (0.8 * a.prefill_tokens_per_s + 0.2 * speed)
            )
        if not a.engine.has_unfinished_requests():
            a.pool.shrink_buffer()  # idle: its decode buffer is memory a colocated model may need
            if self.trace is not None:
                self.trace.flush()
        if not outs:
            return
        deltas = [
            msg.TokenDelta(
                o.req_id,
                o.delta_text,
                o.delta_token_ids,
                o.finished,
                o.finish_reason,
                len(o.prompt_token_ids),
                len(o.token_ids),
                o.logprobs,
                o.prompt_logprobs,
                _timings(o.metrics) if o.finished else None,
                num_cached_tokens=o.num_cached_tokens,
                embedding=None if o.embedding is None else o.embedding.numpy().astype("<f4").tobytes(),
            )
            for o in outs
        ]
        self._send(msg.StepOutputs(deltas, self._stats(a), time.time()))

    def _stats(self, a: _Active) -> msg.EngineStats:
        cached = a.engine.num_cached_blocks * a.pool.block_bytes
        used = a.pool.num_used_blocks * a.pool.block_bytes - cached
        return msg.EngineStats(
            num_running=a.engine.num_running,
            num_waiting=a.engine.num_waiting,
            used_kv_bytes=used,
            mapped_kv_bytes=a.pool.held_bytes,
            weight_bytes=a.weight_bytes,
            prefill_tokens_per_s=a.prefill_tokens_per_s,
            step_seconds=a.step_seconds,
            busy_seconds=a.busy_seconds,
            cpu_seconds=time.process_time() - a.cpu_start,
            decode_sums=a.decode.values() if a.decode.steps else (),
            cached_kv_bytes=cached,
        )

    # ---- activation and eviction --------------------------------------------------------------

    def _activate(self, m: msg.ActivateModel) -> None:
        if self.active is None:  # a Prepare's engine builds not run yet: this one's shape first
            shapes = [item for item in self.to_prepare if isinstance(item, msg.EngineShape)]
            for shape in shapes:
                self.to_prepare.remove(shape)
            self.slot.build_ahead_for(m, shapes)
        t_take = time.monotonic()
        if self.active is not None:
            self._send(msg.ActivationFailed(m.model, "InvalidRequestError", f"busy with {self.active.model}"))
            return
        weight_account = self.ledger.account(f"{m.model} weights")
        kv_account = self.ledger.account(f"{m.model} kv", m.kv_limit_bytes)
        open_file = self.shared.get(m.cache_path)
        prepared = (
            open_file is not None
            and open_file.complete
            and (not self.slot.needs_tokenizer or m.tokenizer_path in self.tokenizers)
        )
        try:
            shared = self._shared(m.cache_path, m.weight_bytes)
            shared.prefault(shared.size)  # what a Prepare left undone of it
            self._pin(shared)
            if m.engine_kind != self.slot.kind:
                raise InvalidRequestError(
                    f"{m.model} runs on the {m.engine_kind} engine; this worker runs {self.slot.kind}"
                )
            t_open = time.monotonic()
            loaded = self.slot.activate(m, shared.bytes, weight_account, kv_account, self._tokenizer)
        except BaseException as e:
            weight_account.close()
            kv_account.close()
            logger.warning("activation of %s failed: %s", m.model, e)
            name = type(e).__name__ if isinstance(e, PrismError) else "PrismError"
            self._send(msg.ActivationFailed(m.model, name, str(e)))
            if not isinstance(e, Exception):
                raise
            return
        self.active = a = _Active(
            m.model, loaded, weight_account, kv_account, m.weight_bytes, cpu_start=time.process_time(),
            synced_at=time.monotonic(), fingerprint=_fingerprint(m),
        )  # fmt: skip
        for f in m.adapters:
            self._register_adapter(a, f)
        t_restore, restored = time.monotonic(), 0
        if m.kept_prefixes:
            try:
                restored = self.slot.restore_prefixes(loaded, m.kept_prefixes, a.fingerprint)
            except Exception as e:  # a file gone or unreadable: the model serves, only colder
                logger.warning("restoring the cached prefixes of %s failed: %s", m.model, e)
        phases = msg.ActivationPhases(
            take_s=max(0.0, t_take - m.sent_at),
            map_s=t_open - t_take + loaded.map_s,
            copy_s=loaded.copy_s,
            ready_s=loaded.ready_s,
            copy_bytes=loaded.copy_bytes,
            copy_threads=self.load_threads,
            reused_pages=loaded.reused_pages,
            created_pages=loaded.created_pages,
            prepared=prepared,
            compiled=loaded.compiled,
            load_path=loaded.load_path,
            restore_s=time.monotonic() - t_restore if m.kept_prefixes else 0.0,
            restored_blocks=restored,
        )
        self._send(
            msg.ModelActivated(
                m.model,
                phases,
                kv_bytes_per_token=loaded.kv_bytes_per_token,
                max_kv_bytes=a.pool.num_total_blocks * a.pool.block_bytes,
                max_model_len=a.engine.max_model_len,
                max_num_seqs=a.engine.config.max_num_seqs,
                stats=self._stats(a),
            )
        )

    def _evict(self, m: msg.EvictModel) -> None:
        a = self.active
        if a is None or a.model != m.model:
            self._send(msg.ModelEvicted(m.model, [], 0))
            return
        in_flight = a.engine.unfinished_request_ids()
        if in_flight and not m.force:
            self._send(msg.EvictRefused(m.model, len(in_flight)))
            return
        for req_id in a.engine.abort_all():
            self._fail(req_id, ModelEvictedError(f"model {m.model} was unloaded while this request ran"))
        t_keep, kept = time.monotonic(), 0
        if m.keep_prefixes and m.keep_prefix_bytes > 0:
            try:
                kept = self.slot.keep_prefixes(a.loaded, m.keep_prefixes, m.keep_prefix_bytes, a.fingerprint)
            except Exception as e:  # the model goes all the same, its prefixes with it
                logger.warning("keeping the cached prefixes of %s failed: %s", m.model, e)
        t_kept = time.monotonic()
        released = self._release(a)
        self._send(msg.ModelEvicted(m.model, in_flight, released, kept, t_kept - t_keep if kept else 0.0))

    def _release(self, a: _Active) -> int:
        """Drop the model and give back every page it mapped; the ranges stay reserved."""
        self.active = None
        before = self.weight_range.mapped_bytes + self.kv_range.mapped_bytes
        try:
            self.slot.release(a.loaded, a.weight_account)
        except Exception as e:
            if a.loaded.world == 1:
                raise
            # rank 0 telling the others to stop found one gone: its pages went back all the same
            logger.warning("closing tensor parallel model %s: %s", a.model, e)
        a.weight_account.close()
        a.kv_account.close()
        return before

    def close(self) -> None:
        if self.active is not None:
            for req_id in self.active.engine.abort_all():
                self._fail(req_id, ModelEvictedError("the worker is shutting down"))
            self._release(self.active)
        self.slot.close()
        for s in self.shared.values():
            s.close()
        self.adapter_files.close()
        self.loader.shutdown()
        if self.trace is not None:
            self.trace.close()
        self.spare.close()
        self.weight_range.close()
        self.kv_range.close()
        self.ledger.close()
        self.sock.close()
        self.ctx.term()


def _fingerprint(m: msg.ActivateModel) -> str:
    """What a model's KV is computed with, as far as a kept prefix file must match it: its weights
    (the host cache file: equal weights share one), their dtype and the KV block size."""
    return f"{m.cache_path}|{m.engine.dtype}|{m.engine.block_size}"


def _timings(m: RequestMetrics) -> msg.RequestTimings | None:
    """A finished request's prefill and decode seconds on this process's clock."""
    if m.first_scheduled_time is None or m.first_token_time is None or m.finish_time is None:
        return None
    return msg.RequestTimings(m.first_token_time - m.first_scheduled_time, m.finish_time - m.first_token_time)


def _die_with_parent() -> None:
    """Linux: the kernel kills this worker when the controller dies, so none is left orphaned."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="prism-worker")
    p.add_argument("--worker-id", required=True)
    p.add_argument("--device", required=True)
    p.add_argument("--memory-bytes", type=int, required=True)
    p.add_argument("--cores", default="")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--reserve-bytes", type=int, required=True)
    p.add_argument("--namespace", default=None)
    p.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE)
    p.add_argument("--load-threads", type=int, default=LOAD_THREADS)
    p.add_argument("--parent-pid", type=int, default=None)
    p.add_argument("--spare-bytes", type=int, default=0, help="weight pages to keep ready (0: none)")
    p.add_argument("--engine", choices=(BuiltinSlot.kind, VllmSlot.kind), default=BuiltinSlot.kind)
    args = p.parse_args(argv)
    _die_with_parent()
    if args.parent_pid is not None and os.getppid() != args.parent_pid:
        return 1  # the controller died before the death signal was armed
    logging.basicConfig(level=logging.WARNING, format=f"[worker {args.worker_id}] %(levelname)s %(message)s")
    cores = parse_cores(args.cores)
    if cores and not args.device.startswith("cuda"):
        # on its device's cores, whatever it inherited (the pool pins it as it starts it; a node
        # agent may not): what the check below asks of a worker is that it can run there
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cores)
    device = DeviceSpec(args.device, args.memory_bytes, cores, 1)  # its own view
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    worker = Worker(
        args.worker_id,
        device,
        args.endpoint,
        args.reserve_bytes,
        args.namespace,
        args.page_size,
        args.load_threads,
        args.spare_bytes,
        args.engine,
    )
    worker.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
