"""Every message between the controller and its workers, in one place.

Messages are msgspec structs, tagged by class name and encoded as MessagePack; one ZeroMQ frame
holds one message. The controller's ROUTER socket addresses a worker by its id (the DEALER's
identity). Times are ``time.monotonic()`` seconds, which every process on the machine shares.

Controller -> worker: Prepare, ActivateModel, EvictModel, AddRequest, AbortRequest, SetKVLimit,
LoadAdapter, UnloadAdapter, Shutdown.
Worker -> controller: WorkerReady, Prepared, ModelActivated, ActivationFailed, ModelEvicted,
StepOutputs, RequestFailed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.sequence import TokenLogprob as TokenLogprob  # re-exported: the engine fills it


class Message(msgspec.Struct, tag=True, array_like=True, forbid_unknown_fields=True):
    """Base of every IPC message (tagged, so one decoder reads them all)."""


# ---- shared pieces ---------------------------------------------------------------------------


ADAPTER_ALIGN = 4096  # a base's adapter slots start at this boundary after its weights


class LoraEntry(msgspec.Struct, array_like=True, frozen=True):
    """One module of an adapter in its host cache file: ``A`` [rank, fan_in] (scale folded in) at
    ``offset``, then ``B`` [fan_out, rank], float32 (engine/lora.py ``LoraAdapter``)."""

    layer: int
    module: str
    offset: int
    rank: int
    fan_in: int
    fan_out: int


class AdapterFile(msgspec.Struct, array_like=True, frozen=True):
    """A LoRA adapter of the model a worker runs (runtime/adapters.py): its name and PEFT directory,
    and where the controller put its checked weights in shared memory (``cache_path``, ``size``
    bytes, laid out by ``entries``; empty where a worker reads the directory itself: vLLM's)."""

    name: str
    path: str
    cache_path: str = ""
    size: int = 0
    rank: int = 0
    entries: tuple[LoraEntry, ...] = ()


class TensorEntry(msgspec.Struct, array_like=True, frozen=True):
    """One tensor in a host weight cache file; the device copy uses the same offset."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "float32"
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class ActivationPhases(msgspec.Struct, array_like=True, frozen=True):
    """Seconds spent in each phase of one activation (paper section 5.2)."""

    take_s: float  # controller decision -> the idle worker starts (queueing for a worker + IPC)
    map_s: float  # ledger grant + mapping the weight pages (and opening the host cache file)
    copy_s: float  # weight bytes host cache -> device pages, parallel chunks
    ready_s: float  # model views, tokenizer, KV pool laid out in the reserved range, engine built
    copy_bytes: int
    copy_threads: int
    reused_pages: int = 0  # weight pages that were spare, already mapped (memory/spare.py)
    created_pages: int = 0  # weight pages created and mapped on this activation's path
    # the host cache file and the tokenizer were opened before (Prepare, or an earlier model)
    prepared: bool = False
    compiled: bool = False  # the engine runs a compiled graph (vLLM's, built ahead under vllm_compile)
    # how the weights came in: "copy" (the built-in engine: the pages' copy above); on vLLM's
    # engine "kept" (the worker's own, swapped back), "plan" (direct copies and repacks) or
    # "reload" (vLLM's own reload), runtime/vllm_slot.py
    load_path: str = "copy"
    # the model's cached prefixes kept in host memory when it was last evicted, read back into its
    # engine's prefix cache before it serves (engine/kept_prefixes.py): seconds and blocks
    restore_s: float = 0.0
    restored_blocks: int = 0

    @property
    def total_s(self) -> float:
        return self.take_s + self.map_s + self.copy_s + self.ready_s + self.restore_s


class EngineStats(msgspec.Struct, array_like=True, frozen=True):
    """What the controller's snapshots need from an engine, sent with every step's outputs."""

    num_running: int
    num_waiting: int
    used_kv_bytes: int
    mapped_kv_bytes: int
    weight_bytes: int
    prefill_tokens_per_s: float | None = None
    # Since the activation: wall seconds the engine spent in steps, and CPU seconds its worker process
    # used. Their ratio shows contention: a step that takes 1 s of wall time but got 0.4 s of CPU
    # shared its cores with colocated engines.
    step_seconds: float = 0.0
    cpu_seconds: float = 0.0
    # the steps' seconds as each would take alone: CPU-timed, each at most its wall time (the
    # control plane's compute demand; step_seconds counts what neighbours took from them too)
    busy_seconds: float = 0.0
    # control.profiles.StepSums of the engine's decode steps since the activation, as its fields in order
    # (empty: none yet); the controller fits step time against batch size from their deltas
    decode_sums: tuple[float, ...] = ()
    # KV blocks the prefix cache keeps that no request holds (not in used_kv_bytes): reclaimable
    cached_kv_bytes: int = 0


class RequestTimings(msgspec.Struct, array_like=True, frozen=True):
    """Where a finished request's time went inside its engine, as durations on the worker's clock
    (durations, so no two processes' clocks need to agree). ``prefill_s``: the engine's first step
    with the request to its first token (recomputation after a preemption included, as vLLM counts
    it); ``decode_s``: first token to the last."""

    prefill_s: float
    decode_s: float


class TokenDelta(msgspec.Struct, array_like=True, frozen=True):
    """What one engine step added to one request's output.

    ``logprobs``: one TokenLogprob per ``token_ids`` entry, when the request asked for them.
    ``prompt_logprobs``: once, in the first delta, one entry per prompt token (index 0 is None: the
    first token has no prefix). Both are the model's raw distribution (see SamplingParams).
    ``timings``: in the finished delta only (for /metrics). ``cold``, ``device`` and ``replica``:
    set by the controller on the finished delta (no replica of the model was active when the
    request arrived; where it ran), for the request log.
    """

    req_id: str
    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    timings: RequestTimings | None = None
    cold: bool | None = None
    device: str | None = None
    replica: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the engine's prefix cache
    embedding: bytes | None = None  # an embedding's vector or a score's logits: float32, little-endian


# ---- controller -> worker --------------------------------------------------------------------


class CacheFile(msgspec.Struct, array_like=True, frozen=True):
    """One host weight cache file (shared memory) and its size."""

    path: str
    size: int


class EngineShape(msgspec.Struct, array_like=True, frozen=True):
    """A model shape a vLLM worker builds its engine for ahead of activations: a model's weights
    directory (only its config and tokenizer files matter), its engine knobs, and whether vLLM
    compiles it (the deployment's ``vllm_compile``)."""

    source: str
    engine: EngineConfig
    compiled: bool = False


class Prepare(Message):
    """What an idle worker opens ahead of any activation, in this order, one piece at a time between
    messages: for a vLLM worker the engine of one model shape (built over dummy weights: seconds),
    then the host cache files (mapped, then pre-faulted in pieces) and the tokenizers (parsed).
    An activation then starts with the copy; without this, a fresh worker's first one also pays those."""

    files: list[CacheFile]
    tokenizers: list[str]
    engines: list[EngineShape] = []


class ActivateModel(Message):
    model: str
    cache_path: str  # host weight cache file (shared memory)
    tensors: list[TensorEntry]
    weight_bytes: int  # the cache file's size: what the weight pages must hold
    config: dict[str, Any]  # ArchConfig fields (engine/models/config.py)
    tokenizer_path: str
    source: str
    synthetic: bool
    engine: EngineConfig  # the worker fills in the KV reservation (kv_cache_bytes) itself
    sent_at: float
    chunk_bytes: int = 16 * 2**20
    kv_limit_bytes: int | None = None  # cap on this engine's KV pages in the ledger (SetKVLimit moves it)
    engine_kind: str = "builtin"  # builtin or vllm: the worker must run the same engine
    # LoRA: the adapters registered in the engine, and the bytes of its adapter slots (mapped with
    # the weights, after them at a 4 KiB boundary; engine.max_loras > 0)
    adapters: list[AdapterFile] = []
    adapter_bytes: int = 0
    # one rank of a tensor parallel model (cache_path, tensors, weight_bytes and config are this
    # rank's shard): the ranks meet at ``tp_init`` (a torch.distributed init_method) and each lays
    # out ``kv_blocks`` KV blocks, mapped at once, as many as every other rank
    tp_rank: int = 0
    tp_size: int = 1
    tp_init: str = ""
    kv_blocks: int = 0
    # a file of the model's cached prefixes kept when it was last evicted: restored into the new
    # engine's prefix cache before it serves ("": none)
    kept_prefixes: str = ""


class EvictModel(Message):
    model: str
    force: bool = False  # False: refuse (EvictRefused) while requests are in flight
    # write the engine's hottest cached prefixes, up to ``keep_prefix_bytes``, to a new file at
    # ``keep_prefixes`` in host memory before the engine goes ("" or 0: keep nothing)
    keep_prefixes: str = ""
    keep_prefix_bytes: int = 0


class AddRequest(Message):
    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams  # the engine's own struct: decoding it validates it again
    adapter: str | None = None  # the LoRA adapter it runs with; None: the base model


class LoadAdapter(Message):
    """Register an adapter in the engine of the model this worker runs (a no-op if none)."""

    adapter: AdapterFile


class UnloadAdapter(Message):
    """Forget an adapter; its requests still running there are aborted (the controller waited)."""

    name: str


class AbortRequest(Message):
    req_id: str


class SetKVLimit(Message):
    limit_bytes: int | None


class Shutdown(Message):
    pass


# ---- worker -> controller --------------------------------------------------------------------


class WorkerReady(Message):
    worker_id: str
    pid: int
    device: str
    reserved_bytes: int  # virtual space reserved for weights and for KV, each
    startup_s: float


class Prepared(Message):
    """The worker finished its Prepare: what it holds open now (failures are logged and skipped)."""

    files: list[str]
    tokenizers: list[str]
    seconds: float
    engines: list[str] = []  # a vLLM worker's built engine: its engine_key (engine/vllm_engine.py)


class ModelActivated(Message):
    model: str
    phases: ActivationPhases
    kv_bytes_per_token: int
    max_kv_bytes: int
    max_model_len: int
    max_num_seqs: int
    stats: EngineStats


class ActivationFailed(Message):
    model: str
    error: str  # class name of a prism_serve error
    message: str


class ModelEvicted(Message):
    model: str
    aborted: list[str]
    released_bytes: int
    kept_prefix_bytes: int = 0  # the size of the file of cached prefixes written (0: none written)
    kept_prefix_s: float = 0.0  # seconds writing it


class EvictRefused(Message):
    model: str
    num_in_flight: int


class ModelLost(Message):
    """A rank of a tensor parallel model lost its group (another rank died): the worker failed the
    model's requests it held, gave back every page and is idle again."""

    model: str
    message: str


class StepOutputs(Message):
    outputs: list[TokenDelta]
    stats: EngineStats
    # the worker's wall clock (time.time()) as it sent this: with the controller's clock on receipt,
    # the transport's share of a token's latency (benchmarks/cluster_token_path.py)
    sent_at: float = 0.0


class RequestFailed(Message):
    req_id: str
    error: str
    message: str


ToWorker = (
    Prepare
    | ActivateModel
    | EvictModel
    | AddRequest
    | AbortRequest
    | SetKVLimit
    | LoadAdapter
    | UnloadAdapter
    | Shutdown
)
FromWorker = (
    WorkerReady
    | Prepared
    | ModelActivated
    | ActivationFailed
    | ModelEvicted
    | EvictRefused
    | ModelLost
    | StepOutputs
    | RequestFailed
)

_ENCODER = msgspec.msgpack.Encoder()


def encode(msg: Message) -> bytes:
    return _ENCODER.encode(msg)


def to_worker_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(ToWorker)


def from_worker_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(FromWorker)
