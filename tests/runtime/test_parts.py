"""The runtime's parts without worker processes: messages, devices, the host weight cache, chunked
copies and the model rebuilt over cache bytes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.models.llama import LlamaForCausalLM
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.runtime import messages as msg
from prism_serve.runtime.devices import DeviceConfigError, DeviceSpec, cpu_devices, parse_cores
from prism_serve.runtime.loading import chunks, parallel_copy, tensor_views
from prism_serve.runtime.models import ModelSpec
from prism_serve.runtime.weight_cache import HostWeightCache, SharedWeights, config_from_dict

PHASES = msg.ActivationPhases(0.001, 0.2, 0.05, 0.01, 1 << 20, 4)
STATS = msg.EngineStats(1, 2, 3, 4, 5, 1000.0)
SAMPLES: list[msg.Message] = [
    msg.ActivateModel(
        "m", "/dev/shm/x", [msg.TensorEntry("norm", "float32", (4,), 0, 16)], 4096, {"a": 1}, "/t",
        "src", True, EngineConfig(model="m", max_num_seqs=8), 1.5, kv_limit_bytes=1 << 28,
    ),
    msg.ActivateModel(
        "m", "/dev/shm/x", [], 4096, {"a": 1}, "/t", "src", False,
        EngineConfig(model="m", max_loras=4, max_lora_rank=8), 1.5,
        adapters=[msg.AdapterFile("support", "/models/support")], adapter_bytes=1 << 20,
    ),
    msg.ActivateModel(
        "m", "/dev/shm/x.1", [], 4096, {"a": 1}, "/t", "src", False, EngineConfig(model="m"), 1.5,
        tp_rank=1, tp_size=2, tp_init="file:///dev/shm/x.tp", kv_blocks=128,
    ),
    msg.Prepare([msg.CacheFile("/dev/shm/x", 4096)], ["/t"]),
    msg.Prepare([], []),
    msg.EvictModel("m", force=True),
    msg.AddRequest("r1", [1, 2, 3], SamplingParams(max_tokens=5, stop=["x"], seed=3)),
    msg.AddRequest("r2", [1], SamplingParams(max_tokens=2), adapter="support"),
    msg.AbortRequest("r1"),
    msg.LoadAdapter(msg.AdapterFile("support", "/models/support")),
    msg.UnloadAdapter("support"),
    msg.SetKVLimit(None),
    msg.SetKVLimit(1 << 30),
    msg.Shutdown(),
    msg.WorkerReady("cpu:0/w0", 123, "cpu:0", 1 << 30, 1.2),
    msg.Prepared(["/dev/shm/x"], ["/t"], 0.25),
    msg.ModelActivated("m", PHASES, 46080, 1 << 30, 2048, 32, STATS),
    msg.ActivationFailed("m", "DeviceMemoryExhaustedError", "full"),
    msg.ModelEvicted("m", ["r1"], 1 << 20),
    msg.EvictRefused("m", 2),
    msg.ModelLost("m", "a rank of tensor parallel model m died"),
    msg.StepOutputs([msg.TokenDelta("r1", "Hi", [5], False, None, 3, 1)], STATS),
    msg.RequestFailed("r1", "ModelEvictedError", "gone"),
]  # fmt: skip


@pytest.mark.parametrize("m", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_message_round_trips_through_its_direction_decoder(m: msg.Message) -> None:
    to_worker = isinstance(m, msg.ToWorker.__args__)
    decoder = msg.to_worker_decoder() if to_worker else msg.from_worker_decoder()
    assert decoder.decode(msg.encode(m)) == m
    other = msg.from_worker_decoder() if to_worker else msg.to_worker_decoder()
    with pytest.raises(msgspec.ValidationError):  # a message never decodes as the other direction
        other.decode(msg.encode(m))


def test_sampling_params_travel_as_themselves_and_are_checked_when_decoded() -> None:
    """AddRequest carries the engine's SamplingParams (no wire copy): decoding gives the same struct,
    validated again, so a value set out of range after construction cannot reach an engine."""
    params = SamplingParams(max_tokens=5, temperature=0.5, stop="x", stop_token_ids=[7], seed=-3)
    decoded = msg.to_worker_decoder().decode(msg.encode(msg.AddRequest("r1", [1], params)))
    assert type(decoded.params) is SamplingParams and decoded.params == params
    assert decoded.params.stop == ["x"]
    params.max_tokens = 0
    with pytest.raises(msgspec.ValidationError, match="max_tokens must be a positive integer"):
        msg.to_worker_decoder().decode(msg.encode(msg.AddRequest("r1", [1], params)))
    # array_like: the params are their values, no field names
    assert b"max_tokens" not in msg.encode(msg.AddRequest("r1", [1], SamplingParams()))


def test_every_message_type_has_a_sample() -> None:
    kinds = {*msg.ToWorker.__args__, *msg.FromWorker.__args__}
    assert kinds == {type(m) for m in SAMPLES}


def test_phases_total() -> None:
    assert PHASES.total_s == pytest.approx(0.261)


def test_cores_and_cpu_devices() -> None:
    assert parse_cores("0-2,5") == (0, 1, 2, 5)
    assert parse_cores([1, 0]) == (1, 0)
    with pytest.raises(DeviceConfigError):
        parse_cores("a-b")
    devices = cpu_devices(2, "1GiB", 2)
    assert [d.name for d in devices] == ["cpu:0", "cpu:1"]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 2:
        assert not set(devices[0].cores) & set(devices[1].cores)  # each device owns its cores
    with pytest.raises(DeviceConfigError, match="cpu:0 or cuda:0"):
        DeviceSpec("gpu0", 1, (), 1)
    with pytest.raises(DeviceConfigError, match="not available"):
        DeviceSpec("cpu:0", 1, (10_000,), 1)
    with pytest.raises(DeviceConfigError, match="positive"):
        DeviceSpec("cpu:0", 0, (), 1)
    # a device of another node (runtime/cluster.py): its cores are that machine's, checked there
    remote = DeviceSpec("n1/cuda:3", 1, (), 1)
    assert (remote.node, remote.local_name, remote.is_cuda) == ("n1", "cuda:3", True)
    assert DeviceSpec("n1/cpu:0", 1, (10_000,), 1).cores == (10_000,)
    assert (DeviceSpec("cpu:0", 1, (), 1).node, DeviceSpec("cpu:0", 1, (), 1).local_name) == ("", "cpu:0")
    with pytest.raises(DeviceConfigError, match="cpu:0 or cuda:0"):
        DeviceSpec("n 1/cpu:0", 1, (), 1)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 5000), min_size=1, max_size=8),
    chunk=st.integers(1, 3000),
)
def test_chunks_cover_every_byte_once_and_the_copy_is_exact(sizes: list[int], chunk: int) -> None:
    entries, offset = [], 0
    for i, n in enumerate(sizes):
        entries.append(msg.TensorEntry(f"t{i}", "uint8", (n,), offset, n))
        offset += n + 7  # gaps between tensors stay untouched
    pieces = chunks(entries, chunk)
    covered = sorted(b for off, n in pieces for b in range(off, off + n))
    assert covered == sorted(b for e in entries for b in range(e.offset, e.offset + e.nbytes))
    assert all(n <= chunk for _, n in pieces)
    src = torch.randint(0, 255, (offset,), dtype=torch.uint8)
    dst = torch.zeros(offset, dtype=torch.uint8)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        assert parallel_copy(src, dst, entries, pool, chunk) == sum(sizes)
    mask = torch.zeros(offset, dtype=torch.bool)
    for e in entries:
        mask[e.offset : e.offset + e.nbytes] = True
    assert torch.equal(dst[mask], src[mask]) and not dst[~mask].any()


@pytest.fixture
def cache(tmp_path: Path):
    with HostWeightCache(namespace="unit", directory=tmp_path) as c:
        yield c


def test_cache_loads_once_shares_files_and_rebuilds_the_same_model(cache: HostWeightCache) -> None:
    # float32, as the reference below (dtype auto is bf16 on a CPU with native bf16)
    spec = ModelSpec("a", source="random:smollm2-135m", engine=EngineConfig(seed=3, dtype="float32"))
    a = cache.load(spec)
    b = cache.load(ModelSpec("b", source="random:smollm2-135m", engine=EngineConfig(seed=3, dtype="float32")))
    c = cache.load(ModelSpec("c", source="random:smollm2-135m", engine=EngineConfig(seed=4, dtype="float32")))
    assert a.path == b.path != c.path and a.synthetic
    assert Path(a.path).stat().st_size == a.weight_bytes and a.weight_bytes % 4096 == 0
    assert all(e.offset % 4096 == 0 for e in a.tensors)
    # The model over the shared bytes computes exactly what a freshly built model computes.
    from prism_serve.engine.weights import load_weights

    ref_w = load_weights("random:smollm2-135m", seed=3)
    ref = LlamaForCausalLM(ref_w.config, ref_w.tensors, torch.float32, 64)
    shared = SharedWeights(a.path, a.weight_bytes)
    try:
        flat = shared.bytes.clone()  # a private copy stands in for the device pages
        model = LlamaForCausalLM.from_packed(
            config_from_dict(a.config), tensor_views(flat, a.tensors), torch.float32, 64
        )
        for name, t in ref.packed_tensors().items():
            assert torch.equal(model.packed_tensors()[name], t), name
    finally:
        shared.close()
    assert c.tokenizer_path == a.tokenizer_path  # other weights, the same tokenizer: one file
    cache.drop("a")
    assert Path(b.path).exists()  # still used by "b"
    cache.drop("b")
    assert not Path(b.path).exists() and Path(c.tokenizer_path).exists()  # "c" still uses it
    cache.drop("c")
    assert not Path(c.path).exists() and not Path(c.tokenizer_path).exists()


def test_prepare_lists_every_file_once_and_caps_the_tokenizers(cache: HostWeightCache) -> None:
    a = cache.load(ModelSpec("a", source="random:smollm2-135m", engine=EngineConfig(seed=1, dtype="float32")))
    cache.load(
        ModelSpec("a2", source="random:smollm2-135m", engine=EngineConfig(seed=1, dtype="float32"))
    )  # a's file
    b = cache.load(ModelSpec("b", source="random:smollm2-135m", engine=EngineConfig(seed=2, dtype="float32")))
    m = cache.prepare_message()
    assert m.files == [msg.CacheFile(a.path, a.weight_bytes), msg.CacheFile(b.path, b.weight_bytes)]
    assert m.tokenizers == [a.tokenizer_path]
    size = Path(a.tokenizer_path).stat().st_size
    assert cache.prepare_message(tokenizer_bytes=size).tokenizers == [a.tokenizer_path]
    assert cache.prepare_message(tokenizer_bytes=size - 1).tokenizers == []


def test_prepare_for_one_engine_lists_only_its_models_files(cache: HostWeightCache, tmp_path: Path) -> None:
    from prism_serve.engine.weights import load_weights, save_hf_dir

    hf = tmp_path / "hf"
    save_hf_dir(load_weights("random:smollm2-135m", dtype=torch.bfloat16, seed=3), hf)
    a = cache.load(ModelSpec("a", source="random:smollm2-135m", engine=EngineConfig(seed=1, dtype="float32")))
    v = cache.load(ModelSpec("v", source=str(hf), engine_kind="vllm", engine=EngineConfig(dtype="bfloat16")))
    assert v.path != a.path
    builtin, vllm = cache.prepare_message(engine="builtin"), cache.prepare_message(engine="vllm")
    assert builtin.files == [msg.CacheFile(a.path, a.weight_bytes)]
    assert vllm.files == [msg.CacheFile(v.path, v.weight_bytes)]
    assert [f.path for f in cache.prepare_message().files] == [a.path, v.path]


def test_files_of_dead_controllers_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / "prism-weights-unit-999999999-1"
    stale.write_bytes(b"x")
    mine = tmp_path / f"prism-weights-unit-{os.getpid()}-1"
    mine.write_bytes(b"x")
    with HostWeightCache(namespace="unit", directory=tmp_path):
        assert not stale.exists() and mine.exists()


FULL_SCRIPT = """
import json, os, resource, signal, sys
import torch
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.lora import LoraAdapter
from prism_serve.runtime.models import ModelSpec
from prism_serve.runtime.weight_cache import HostWeightCache
folder = sys.argv[1]
# no file may grow past 8 MiB (as a full /dev/shm refuses memory): the process gets EFBIG, not SIGXFSZ
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 20, 8 << 20))
out = {}
with HostWeightCache("full", folder) as cache:
    try:
        cache.load(ModelSpec("big", source="random:smollm2-135m", engine=EngineConfig(dtype="float32")))
    except Exception as e:
        out["error"] = [type(e).__name__, getattr(e, "status_code", None), str(e)]
    out["after_error"] = sorted(os.listdir(folder))
    small = LoraAdapter("x", "/x", 1, ("q_proj",), {(0, "q_proj"): (torch.ones(1, 4), torch.ones(4, 1))})
    out["still_writes"] = os.path.exists(cache.write_adapter(small).cache_path)
out["after_close"] = sorted(os.listdir(folder))
print(json.dumps(out))
"""


def test_a_cache_directory_without_room_is_a_named_error_not_a_dead_process(tmp_path: Path) -> None:
    """A model whose cache file does not fit (a full /dev/shm) fails with HostCacheFullError (503)
    and leaves no file; the cache goes on writing what fits. The file's memory is taken when it is
    created: a copy through the mapping into memory the filesystem cannot give would kill the
    process with SIGBUS instead."""
    done = subprocess.run(
        [sys.executable, "-c", FULL_SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    name, status, text = out["error"]
    assert (name, status) == ("HostCacheFullError", 503)
    assert str(tmp_path) in text and "MiB cache file" in text
    assert out["after_error"] == []  # the failed file went
    assert out["still_writes"] is True
    assert out["after_close"] == []


def test_a_cache_file_is_prefaulted_piece_by_piece_and_reads_the_same(cache: HostWeightCache) -> None:
    """A pooled worker maps a cache file without populating it and pre-faults it one piece per poll
    (Prepare); the bytes it reads are the file's either way."""
    from prism_serve.runtime.weight_cache import PREFAULT_CHUNK_BYTES

    a = cache.load(ModelSpec("a", source="random:smollm2-135m", engine=EngineConfig(seed=1, dtype="float32")))
    whole = SharedWeights(a.path, a.weight_bytes)
    lazy = SharedWeights(a.path, a.weight_bytes, populate=False)
    try:
        assert whole.complete and not lazy.complete and lazy.faulted == 0
        piece = 64 * 4096
        steps = 0
        while not lazy.prefault(piece):
            steps += 1
            assert lazy.faulted == steps * piece
        assert lazy.faulted == a.weight_bytes and steps == -(-a.weight_bytes // piece) - 1
        assert lazy.prefault(piece) and lazy.faulted == a.weight_bytes  # done stays done
        assert torch.equal(lazy.bytes, whole.bytes)
        assert PREFAULT_CHUNK_BYTES % 4096 == 0  # every piece starts on a page
    finally:
        whole.close()
        lazy.close()
