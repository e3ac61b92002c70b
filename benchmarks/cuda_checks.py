"""The CUDA path measured on a GPU, in one run that fits a short lease of a GPU machine.

Sections (each runs even if an earlier one failed; every number is from this run and this GPU):

* ``link``: host-to-device bandwidth from pinned memory (one 2 GiB copy, best of 5), and a
  device-to-device copy (bytes read + written), the ceilings the later numbers are compared with.
* ``vmm``: per 2 MiB page, the five phases of the cuda backend of memory/vmm.py (cuMemCreate,
  cuMemMap, cuMemSetAccess, cuMemUnmap, cuMemRelease) in microseconds, median and p90 of 512.
* ``stridedkv``: vLLM's layer-by-layer KV layout with pages on demand (memory/strided_kv.py) on
  SmolLM2-135M and Llama-8B KV shapes: the cost of growing and shrinking by one prefill chunk.
* ``smollm``: the engine on SYNTHETIC SmolLM2-135M-shaped weights in bf16: decode tokens/s at
  batch 1 / 32 / 128 / 256 with CUDA graphs and without, prefill tokens/s, and the elastic KV pool
  against a fixed pool on the same requests (6 runs each, alternated; medians).
* ``llama8b``: the same on a SYNTHETIC Llama-3.1-8B shape (weights drawn on the GPU, ~16 GB bf16).
* ``pool8b``: elastic against fixed KV pool on that 8B shape, batch 128 (the GPU's work dominates
  its steps, so run-to-run noise is small; SmolLM2's steps are mostly host time).
* ``prefill``: the paged prefill kernel against one SDPA call per chunk
  (``PRISM_CUDA_PREFILL_KERNEL=0``) on both shapes: 4 x 1,024-token prompts in one step, 64 x 128,
  and 2 x 4,096 in chunks of 1,024 (chunks after the first attend to a cached prefix).
* ``activation``: a SYNTHETIC 8B shape written to a host cache file in /dev/shm, page-locked,
  then activated into a weight range the way a pooled worker does (runtime/loading.py): cold
  (every 2 MiB page created on the hot path) and warm (the pages an evicted model left as spare
  pages: no page created, only the copy); seconds, GB/s, and the ratio to the link's bandwidth.
* ``hf``: HF transformers' ``generate`` on the same SmolLM2-shaped weights, batch 32, as a
  baseline in the same run (vLLM's CUDA wheels are ~400 MB and cannot be carried to the machine).
* ``architectures``: each architecture of the built-in engine (Llama, Qwen3, Qwen3-MoE, Qwen2-MoE,
  Phi-3, Gemma 2 and 3 with sliding windows past which the prompts run and their blocks freed) as a tiny
  SYNTHETIC model in fp32: 16 prompts of 3-60 tokens, 24 greedy tokens each, batched in one engine
  with chunked prefill, against transformers' greedy tokens on the same weights and device; and
  a BERT embedder's mean-pooled vectors against transformers' (cosine). ``--device cpu`` runs this
  section on the host, to check the section itself.

    python benchmarks/cuda_checks.py --out results/cuda            # everything (~3 min on an H100)
    python benchmarks/cuda_checks.py --sections vmm,smollm        # some of it
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from prism_serve.engine.llm_engine import EngineConfig, LLMEngine
from prism_serve.engine.models.config import PRESETS, ArchConfig, parameter_shapes
from prism_serve.engine.models.llama import LlamaForCausalLM
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.weights import LoadedWeights, byte_tokenizer, load_weights
from prism_serve.memory.kv_pool import PoolConfig
from prism_serve.memory.ledger import NAMESPACE_ENV, DeviceLedger
from prism_serve.memory.spare import SparePages
from prism_serve.memory.vmm import PHASES, reserve
from prism_serve.runtime.loading import map_weight_pages, parallel_copy, tensor_views, unmap_weight_pages
from prism_serve.runtime.weight_cache import SharedWeights, cache_layout

GiB = 2**30
DEV = "cuda:0"
RESULTS: dict = {}


def log(*a: object) -> None:
    print(*a, flush=True)


def sync() -> None:
    torch.cuda.synchronize()


# ---- link --------------------------------------------------------------------------------------


def section_link() -> dict:
    n = 2 * GiB
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host.random_(0, 255)
    dev = torch.empty(n, dtype=torch.uint8, device=DEV)
    h2d = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        dev.copy_(host, non_blocking=True)
        sync()
        h2d.append(n / (time.perf_counter() - t0))
    dev2 = torch.empty_like(dev)
    d2d = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        dev2.copy_(dev)
        sync()
        d2d.append(2 * n / (time.perf_counter() - t0))
    out = {"h2d_pinned_GBps": max(h2d) / 1e9, "d2d_GBps_read_plus_write": max(d2d) / 1e9}
    log(
        f"link: host->device pinned {out['h2d_pinned_GBps']:.1f} GB/s, "
        f"device copy {out['d2d_GBps_read_plus_write']:.0f} GB/s"
    )
    return out


# ---- vmm ---------------------------------------------------------------------------------------


def section_vmm(pages: int = 512) -> dict:
    out: dict = {}
    with reserve(DEV, pages * 2 * 2**20) as r:
        t = r.as_tensor()
        for p in range(8):  # warm the driver's paths
            r.map_page(p)
        for p in range(8):
            r.unmap_page(p)
        r.record_phases = True
        for p in range(pages):
            r.map_page(p)
        t.view(pages, -1)[:, :4096].fill_(3)  # every page written through the one tensor
        sync()
        assert int(t.view(pages, -1)[:, :4096].sum(dtype=torch.int64)) == 3 * 4096 * pages
        for p in range(0, pages, 2):
            r.unmap_page(p)
        assert int(t.view(pages, -1)[1::2, :4096].sum(dtype=torch.int64)) == 3 * 4096 * (pages // 2)
        for p in range(1, pages, 2):
            r.unmap_page(p)
        for phase in PHASES:
            us = sorted(ns / 1e3 for ns in r.phase_ns[phase])
            out[phase] = {"median_us": statistics.median(us), "p90_us": us[int(0.9 * (len(us) - 1))]}
        # map_pages: runs of 16 neighbours, one cuMemSetAccess each (the KV pool's prefetch batches)
        r.record_phases = False
        t0 = time.perf_counter()
        for first in range(0, pages, 16):
            r.map_pages(list(range(first, min(first + 16, pages))))
        batched_us = (time.perf_counter() - t0) * 1e6 / pages
        t.view(pages, -1)[:, :4096].fill_(5)
        sync()
        assert int(t.view(pages, -1)[:, :4096].sum(dtype=torch.int64)) == 5 * 4096 * pages
        for p in range(pages):
            r.unmap_page(p)
    per_page_us = sum(out[ph]["median_us"] for ph in ("create", "map", "set_access"))
    out["map_pages_16_us_per_page"] = batched_us
    log(
        "vmm per 2 MiB page (us, median / p90): "
        + ", ".join(f"{k} {v['median_us']:.1f}/{v['p90_us']:.1f}" for k, v in out.items() if k in PHASES)
    )
    log(f"  map_pages in runs of 16: {batched_us:.1f} us a page (create + map + set access one by one, "
        f"medians: {per_page_us:.1f} us)")  # fmt: skip
    return out


# ---- stridedkv ---------------------------------------------------------------------------------


def section_stridedkv() -> dict:
    """vLLM's layer-by-layer KV layout with pages on demand (memory/strided_kv.py), the vLLM
    engine's device path without vLLM: growing a request's blocks chunk by chunk (16 blocks = 256
    tokens, a prefill chunk) to the whole buffer, then shrinking in the same steps. Crossing a 2 MiB
    page maps one page in every layer at once; the per-step cost is what fit_pages adds to a step."""
    from prism_serve.memory.strided_kv import StridedKVPages

    out: dict = {}
    os.environ[NAMESPACE_ENV] = f"bench{uuid.uuid4().hex[:8]}"
    ledger = DeviceLedger(DEV, torch.cuda.mem_get_info()[1])
    shapes = (("smollm2-135m", 30, 2 * 16 * 3 * 64 * 2, 8192), ("llama-8b", 32, 2 * 16 * 8 * 128 * 2, 4096))
    for name, layers, block_bytes, blocks in shapes:
        size = -(-(layers * blocks * block_bytes) // (2 * 2**20)) * 2 * 2**20
        with reserve(DEV, size) as r:
            kv = StridedKVPages(r, layers, blocks * block_bytes, block_bytes, blocks)
            kv.attach(ledger.account(f"{name} kv"))
            kv.resize(1)
            flat = r.as_tensor()
            grow, shrink, pages_per_step = [], [], []
            for w in range(17, blocks + 1, 16):
                before = len(kv.mapped)
                t0 = time.perf_counter()
                assert kv.resize(w)
                grow.append(time.perf_counter() - t0)
                pages_per_step.append(len(kv.mapped) - before)
            flat.view(layers, -1)[:, ::4096].fill_(7)  # a byte of every 4 KiB of every layer, one kernel
            sync()
            for w in range(blocks - 16, 0, -16):
                t0 = time.perf_counter()
                assert kv.resize(w)
                shrink.append(time.perf_counter() - t0)
            kv.close()
            crossing = [t for t, n in zip(grow, pages_per_step, strict=True) if n]
            out[name] = {
                "blocks": blocks, "block_bytes": block_bytes, "layers": layers, "steps": len(grow),
                "grow_step_median_us": statistics.median(grow) * 1e6,
                "grow_step_p99_us": sorted(grow)[int(0.99 * (len(grow) - 1))] * 1e6,
                "grow_step_max_us": max(grow) * 1e6,
                "steps_mapping_pages": len(crossing),
                "mapping_step_median_us": statistics.median(crossing) * 1e6 if crossing else 0.0,
                "pages_per_mapping_step": statistics.median([n for n in pages_per_step if n]),
                "us_per_page": sum(crossing) / max(1, sum(pages_per_step)) * 1e6,
                "shrink_step_median_us": statistics.median(shrink) * 1e6,
                "shrink_step_max_us": max(shrink) * 1e6,
            }  # fmt: skip
            o = out[name]
            log(
                f"stridedkv {name}: {o['steps']} steps of 16 blocks; step median "
                f"{o['grow_step_median_us']:.0f} us, p99 {o['grow_step_p99_us']:.0f}, "
                f"max {o['grow_step_max_us']:.0f}; {o['steps_mapping_pages']} steps map pages "
                f"({o['pages_per_mapping_step']:.0f} each, median {o['mapping_step_median_us']:.0f} us, "
                f"{o['us_per_page']:.1f} us/page); shrink step median "
                f"{o['shrink_step_median_us']:.0f} us, max {o['shrink_step_max_us']:.0f}"
            )
    ledger.close()
    return out


# ---- engine throughput ---------------------------------------------------------------------------


def drive(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    """Run ``prompts`` to completion; tokens/s of the steps that decoded only, and of the others."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    dec_t = dec_n = pre_t = pre_n = 0.0
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        engine.step()  # ends in the sampled tokens' copy to the host: the step is done
        dt = time.perf_counter() - t0
        if engine.last_step_tokens == engine.last_step_seqs:
            dec_t, dec_n = dec_t + dt, dec_n + engine.last_step_tokens
        else:
            pre_t, pre_n = pre_t + dt, pre_n + engine.last_step_tokens
    return {
        "decode_tok_s": dec_n / dec_t if dec_t else 0.0,
        "prefill_tok_s": pre_n / pre_t if pre_t else 0.0,
        "decode_steps_s": dec_t,
        "decode_tokens": dec_n,
    }


def prompts_of(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, min(vocab, 50000), (n, length), generator=g).tolist()


def measure(engine: LLMEngine, label: str, batch: int, prompt_len: int, out_len: int, vocab: int) -> dict:
    drive(engine, prompts_of(batch, prompt_len, vocab, 0), 4)  # warm-up: kernels, graphs of this size
    r = drive(engine, prompts_of(batch, prompt_len, vocab, 1), out_len)
    log(
        f"  {label} batch {batch:3d}: decode {r['decode_tok_s']:9.0f} tok/s, "
        f"prefill {r['prefill_tok_s']:9.0f} tok/s"
    )
    return r


def engine_sweep(
    weights: LoadedWeights,
    model: LlamaForCausalLM | None,
    batches: list[int],
    kv_bytes: int,
    prompt_len: int,
    out_len: int,
    graphs_off_batches: list[int],
) -> dict:
    vocab = weights.config.vocab_size
    config = EngineConfig(
        dtype="bfloat16",
        device=DEV,
        max_num_seqs=max(batches),
        max_model_len=4096,
        max_num_batched_tokens=8192,
        kv_cache_bytes=kv_bytes,
    )
    out: dict = {"graphs": {}, "eager": {}}
    with LLMEngine(config, weights=weights, model=model) as engine:
        for b in batches:
            out["graphs"][b] = measure(engine, "graphs", b, prompt_len, out_len, vocab)
        out["prefill_4x1024"] = drive(engine, prompts_of(4, 1024, vocab, 5), 1)["prefill_tok_s"]
        log(f"  prefill 4 x 1024 tokens: {out['prefill_4x1024']:.0f} tok/s")
    os.environ["PRISM_CUDA_GRAPHS"] = "0"
    try:
        with LLMEngine(config, weights=weights, model=model) as engine:
            for b in graphs_off_batches:
                out["eager"][b] = measure(engine, "eager ", b, prompt_len, out_len, vocab)
    finally:
        del os.environ["PRISM_CUDA_GRAPHS"]
    torch.cuda.empty_cache()
    return out


def section_smollm() -> dict:
    weights = load_weights("random:smollm2-135m", dtype=torch.float32, seed=1)
    out = engine_sweep(weights, None, [1, 32, 128, 256], 8 * GiB, 128, 128, [1, 32, 128])
    out["pool"] = compare_pools(weights, None, 128, 128, 6)
    return out


# Elastic pools compared with the fixed one: name -> PoolConfig fields (the rest are a GPU pool's
# defaults). "per-page" is the pool as first measured on an H200 (0.964x): every emptied
# page beyond the buffer unmapped at once, the thread mapping one page per call.
POOL_VARIANTS = {
    "per-page": {"linger_s": 0.0, "map_batch_pages": 1},
    "batched": {"linger_s": 0.0},
    "default": {},
}


def compare_pools(weights: LoadedWeights, model: LlamaForCausalLM | None, batch: int, out_len: int,
                  runs_each: int, variants: dict[str, dict] | None = None) -> dict:  # fmt: skip
    """Decode tokens/s of the elastic KV pool over the fixed pool: one engine each over the same
    model, the same requests, runs alternated; ratios of medians and of bests. ``variants``: the
    elastic pools (one engine each; default: the GPU pool's defaults)."""
    os.environ[NAMESPACE_ENV] = f"bench{uuid.uuid4().hex[:8]}"
    vocab = weights.config.vocab_size
    common = dict(dtype="bfloat16", device=DEV, max_num_seqs=batch, kv_cache_bytes=8 * GiB)
    engines = {"fixed": LLMEngine(EngineConfig(**common), weights=weights, model=model)}
    for name, fields in (variants or {"default": {}}).items():
        pool = PoolConfig(device=DEV, device_budget_bytes=32 * GiB, buffer_min_pages=2, **fields)
        config = EngineConfig(**common, elastic_kv=pool)
        engines[f"elastic-{name}"] = LLMEngine(config, weights=weights, model=model)
    runs: dict[str, list[float]] = {name: [] for name in engines}
    for e in engines.values():
        drive(e, prompts_of(batch, 128, vocab, 0), 4)
    for i in range(runs_each):
        for name, e in engines.items():
            runs[name].append(drive(e, prompts_of(batch, 128, vocab, 10 + i), out_len)["decode_tok_s"])
    out: dict = {"runs": runs, "median": {k: statistics.median(v) for k, v in runs.items()}}
    for name, e in engines.items():
        if name != "fixed":
            st = e.allocator.stats()
            out[name] = {
                "over_fixed": out["median"][name] / out["median"]["fixed"],
                "best_over_best": max(runs[name]) / max(runs["fixed"]),
                "sync_maps": st.sync_maps, "prefetch_maps": st.prefetch_maps, "unmaps": st.unmaps,
            }  # fmt: skip
            log(
                f"  {name} / fixed KV pool, decode at batch {batch}, median of {runs_each} alternated runs: "
                f"{out[name]['over_fixed']:.3f} ({out['median'][name]:.0f} vs {out['median']['fixed']:.0f} "
                f"tok/s; best/best {out[name]['best_over_best']:.3f}); pages mapped on the engine's "
                f"thread {st.sync_maps}, by the prefetch thread {st.prefetch_maps}"
            )
        e.close()
    torch.cuda.empty_cache()
    return out


def llama8b_on_gpu() -> tuple[LoadedWeights, LlamaForCausalLM]:
    """A SYNTHETIC Llama-3.1-8B shape, drawn on the GPU in bf16 (~16 GB), with its byte tokenizer."""
    config = PRESETS["llama-3.1-8b"]
    packed = random_packed(config, torch.bfloat16, DEV, 0)
    model = LlamaForCausalLM.from_packed(config, packed, torch.bfloat16, 4096)
    return LoadedWeights(config, {}, byte_tokenizer(), "random:llama-3.1-8b (on the GPU)", True), model


def section_pool8b() -> dict:
    weights, model = llama8b_on_gpu()
    return compare_pools(weights, model, 128, 64, 6, variants=POOL_VARIANTS)


def packed_meta(config: ArchConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The engine's packed tensors of ``config`` on the meta device: names, shapes, no memory."""
    meta = {n: torch.empty(s, dtype=dtype, device="meta") for n, s in parameter_shapes(config).items()}
    return LlamaForCausalLM(config, meta, dtype, max_positions=1).packed_tensors()


def random_packed(config: ArchConfig, dtype: torch.dtype, device: str, seed: int) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    out = {}
    for name, m in packed_meta(config, dtype).items():
        t = torch.empty(m.shape, dtype=m.dtype, device=device)
        out[name] = t.fill_(1.0) if name.endswith("norm") else t.normal_(0.0, 0.02)
    return out


def section_llama8b() -> dict:
    weights, model = llama8b_on_gpu()
    log(f"  8B shape: {model.weight_bytes / 1e9:.2f} GB of bf16 weights on the GPU")
    out = engine_sweep(weights, model, [1, 32, 128], 24 * GiB, 128, 64, [1, 32])
    out["weight_GB"] = model.weight_bytes / 1e9
    del model
    torch.cuda.empty_cache()
    return out


# ---- activation ----------------------------------------------------------------------------------


def prefill_rates(weights: LoadedWeights, model: LlamaForCausalLM | None) -> dict:
    """Prefill tokens/s (best of 3 after a warm-up) of three workloads: 4 prompts of 1,024 tokens
    in one step; 64 of 128 (many chunks a step); 2 of 4,096 in chunks of 1,024 (each chunk after
    the first attends to a cached prefix)."""
    vocab = weights.config.vocab_size
    out = {}
    for label, n, length, step_tokens in (("4x1024", 4, 1024, 8192), ("64x128", 64, 128, 8192),
                                          ("2x4096 chunked", 2, 4096, 1024)):  # fmt: skip
        config = EngineConfig(dtype="bfloat16", device=DEV, max_num_seqs=256, max_model_len=8192,
                              max_num_batched_tokens=step_tokens, kv_cache_bytes=8 * GiB)  # fmt: skip
        with LLMEngine(config, weights=weights, model=model) as engine:
            drive(engine, prompts_of(n, length, vocab, 7), 1)
            runs = [drive(engine, prompts_of(n, length, vocab, 8 + i), 1) for i in range(3)]
            out[label] = max(r["prefill_tok_s"] for r in runs)
    return out


def section_prefill() -> dict:
    """The paged prefill kernel against one SDPA call per chunk, on the SmolLM2 and 8B shapes."""
    shapes = {"smollm2": (load_weights("random:smollm2-135m", dtype=torch.float32, seed=1), None),
              "llama8b": llama8b_on_gpu()}  # fmt: skip
    out: dict = {}
    for shape, (weights, model) in shapes.items():
        for path, env in (("kernel", "1"), ("sdpa", "0")):
            os.environ["PRISM_CUDA_PREFILL_KERNEL"] = env
            try:
                out[f"{shape}/{path}"] = rates = prefill_rates(weights, model)
            finally:
                del os.environ["PRISM_CUDA_PREFILL_KERNEL"]
            log(f"  {shape} prefill, {path}: " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in rates.items()))
        for label in out[f"{shape}/kernel"]:
            ratio = out[f"{shape}/kernel"][label] / out[f"{shape}/sdpa"][label]
            out[f"{shape}/kernel_over_sdpa/{label}"] = ratio
            log(f"  {shape} {label}: kernel / SDPA per chunk = {ratio:.2f}x")
        del model
        torch.cuda.empty_cache()
    return out


def section_activation(link_GBps: float | None) -> dict:
    config = PRESETS["llama-3.1-8b"]
    dtype = torch.bfloat16
    entries, size = cache_layout(packed_meta(config, dtype))  # the host cache's own layout
    shm = os.statvfs("/dev/shm")
    where = "/dev/shm" if shm.f_bavail * shm.f_frsize > size + GiB else None  # else the temp directory
    path = Path(tempfile.mkdtemp(dir=where)) / "llama8b.bin"
    log(f"  host cache file in {path.parent}")
    t0 = time.perf_counter()
    with open(path, "wb") as f:
        f.truncate(size)
    import mmap

    fd = os.open(path, os.O_RDWR)
    mm = mmap.mmap(fd, size)
    os.close(fd)
    flat_host = torch.frombuffer(mm, dtype=torch.uint8)
    gen = torch.Generator(device=DEV).manual_seed(0)
    checks = {}
    for e in entries:  # SYNTHETIC values drawn on the GPU, written to the cache file
        t = torch.empty(e.shape, dtype=dtype, device=DEV)
        if e.name.endswith("norm"):
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=gen)
        flat_host[e.offset : e.offset + e.nbytes].copy_(t.view(-1).view(torch.uint8).cpu())
        if e.name in ("lm_head", "layers.31.down", "norm"):
            checks[e.name] = float(t.float().sum())
        del t
    del flat_host
    mm.close()
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    shared = SharedWeights(str(path), size, populate=True)
    map_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    pinned = shared.pin()
    pin_s = time.perf_counter() - t0
    log(
        f"  host cache: {size / 1e9:.2f} GB written in {write_s:.1f} s, mapped {map_s:.1f} s, "
        f"page-locked {pinned} in {pin_s:.1f} s"
    )
    os.environ[NAMESPACE_ENV] = f"bench{uuid.uuid4().hex[:8]}"
    ledger = DeviceLedger(DEV, torch.cuda.mem_get_info()[1])
    vrange = reserve(DEV, size + 64 * 2**20)
    spare = SparePages(vrange, ledger, "spare", target_bytes=size, thread=False)
    out: dict = {"weight_bytes": size, "pinned": pinned, "pin_s": pin_s, "runs": []}
    for threads in (4,):
        pool = ThreadPoolExecutor(threads)
        for i in range(4):  # run 0 is cold: every page is created on the hot path
            account = ledger.account(f"8b-{i} weights")
            sync()
            t0 = time.perf_counter()
            n, reused = map_weight_pages(vrange, account, size, pool, spare)
            t1 = time.perf_counter()
            copied = parallel_copy(shared.bytes, vrange.as_tensor(), entries, pool, 64 * 2**20)
            sync()
            t2 = time.perf_counter()
            model = LlamaForCausalLM.from_packed(
                config, tensor_views(vrange.as_tensor(), entries), dtype, 4096
            )
            sync()
            t3 = time.perf_counter()
            got = {k: float(model_tensor(model, k).float().sum()) for k in checks}
            ok = all(abs(got[k] - checks[k]) <= 1e-3 * max(1.0, abs(checks[k])) for k in checks)
            run = {
                "threads": threads,
                "created_pages": n - reused,
                "reused_pages": reused,
                "map_s": t1 - t0,
                "copy_s": t2 - t1,
                "build_s": t3 - t2,
                "total_s": t3 - t0,
                "copy_GBps": copied / (t2 - t1) / 1e9,
                "bytes_match": ok,
            }
            if link_GBps:
                run["copy_vs_link"] = run["copy_GBps"] / link_GBps
            out["runs"].append(run)
            log(
                f"  activation {i} ({'cold' if i == 0 else 'warm'}): {run['total_s']:.3f} s "
                f"= map {run['map_s']:.3f} "
                f"+ copy {run['copy_s']:.3f} ({run['copy_GBps']:.1f} GB/s) + build {run['build_s']:.3f}; "
                f"created {run['created_pages']} pages, reused {reused}; bytes match {ok}"
            )
            if i == 3:  # the activated model serves
                w = LoadedWeights(config, {}, byte_tokenizer(), "random:llama-3.1-8b", True)
                with LLMEngine(
                    EngineConfig(dtype="bfloat16", device=DEV, kv_cache_bytes=GiB), weights=w, model=model
                ) as engine:
                    r = drive(engine, prompts_of(2, 16, config.vocab_size, 3), 8)
                    out["served_after_activation"] = r["decode_tokens"] > 0
            del model
            unmap_weight_pages(vrange, account, n, spare)
            account.close()
        pool.shutdown()
    warm = [r["total_s"] for r in out["runs"][1:]]
    out["warm_best_s"] = min(warm)
    out["cold_s"] = out["runs"][0]["total_s"]
    spare.close()
    vrange.close()
    ledger.close()
    shared.close()
    path.unlink()
    path.parent.rmdir()
    return out


def model_tensor(model: LlamaForCausalLM, name: str) -> torch.Tensor:
    if name == "lm_head":
        return model.lm_head.weight
    if name == "norm":
        return model.norm
    i = int(name.split(".")[1])
    return model.layers[i].down.weight


# ---- HF baseline ---------------------------------------------------------------------------------


def section_hf() -> dict:
    from prism_serve.engine.hf_reference import build_hf_model

    weights = load_weights("random:smollm2-135m", dtype=torch.float32, seed=1)
    hf = build_hf_model(weights).to(device=DEV, dtype=torch.bfloat16)
    out = {}
    for batch in (1, 32):
        ids = torch.tensor(prompts_of(batch, 128, 49152, 1), device=DEV)
        kw = dict(do_sample=False, pad_token_id=0, attention_mask=torch.ones_like(ids))
        hf.generate(ids, max_new_tokens=4, min_new_tokens=4, **kw)
        sync()
        t0 = time.perf_counter()
        hf.generate(ids, max_new_tokens=1, min_new_tokens=1, **kw)
        sync()
        t1 = time.perf_counter()
        hf.generate(ids, max_new_tokens=128, min_new_tokens=128, **kw)
        sync()
        t2 = time.perf_counter()
        out[batch] = {"decode_tok_s": batch * 127 / ((t2 - t1) - (t1 - t0))}
        log(f"  HF generate batch {batch:3d}: decode {out[batch]['decode_tok_s']:9.0f} tok/s")
    return out


# ---- architectures against transformers ----------------------------------------------------------

_TINY = ArchConfig("llama", 256, 64, 128, 2, 4, 2, 16, 512, 10000.0, 1e-5, tie_word_embeddings=False)
TINY_ARCHITECTURES = {
    "llama": _TINY,
    "qwen3": dataclasses.replace(_TINY, architecture="qwen3", head_dim=32),
    "qwen3_moe": dataclasses.replace(_TINY, architecture="qwen3_moe", head_dim=32, num_experts=8,
                                     experts_per_token=2, moe_intermediate_size=64, norm_topk_prob=True),
    "qwen2_moe": dataclasses.replace(_TINY, architecture="qwen2_moe", attention_bias=True, num_experts=8,
                                     experts_per_token=2, moe_intermediate_size=64,
                                     shared_expert_intermediate_size=128),
    "phi3": dataclasses.replace(_TINY, architecture="phi3", sliding_window=100),
    "gemma2": dataclasses.replace(_TINY, architecture="gemma2", sliding_window=16, global_layers=(1,),
                                  attn_softcap=2.0, final_softcap=0.25, tie_word_embeddings=True),
    "gemma3": dataclasses.replace(_TINY, architecture="gemma3", num_layers=6, sliding_window=16,
                                  global_layers=(5,), rope_theta=1e6, rope_local_theta=1e4,
                                  rope_linear_factor=8.0, tie_word_embeddings=True),
}  # fmt: skip


def _distinct(weights: LoadedWeights) -> LoadedWeights:
    """Queries, keys and biases drawn large enough that positions and biases change the tokens."""
    for name, t in weights.tensors.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            t.normal_(0, 0.5)
        elif name.endswith("bias"):
            t.normal_(0, 1.0)
    return weights


def section_architectures() -> dict:
    from prism_serve.engine.hf_reference import build_hf_model, write_synthetic_encoder
    from prism_serve.engine.llm import LLM
    from prism_serve.engine.weights import random_weights

    out = {}
    gen = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(0, 256, (int(n),), generator=gen).tolist()
        for n in torch.randint(3, 61, (16,), generator=gen)
    ]
    for arch, config in TINY_ARCHITECTURES.items():
        weights = _distinct(random_weights(config, seed=2))
        llm = LLM(weights=weights, block_size=16, num_kv_blocks=512, max_num_batched_tokens=64,
                  dtype="float32", device=DEV)  # fmt: skip
        greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        ours = [o.token_ids for o in llm.generate(prompts, greedy)]
        hf = build_hf_model(weights, torch.float32).to(DEV)
        same = total = 0
        with torch.inference_mode():
            for p, mine in zip(prompts, ours, strict=True):
                ids = torch.tensor([p], device=DEV)
                theirs = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=24,
                                     do_sample=False, eos_token_id=None, pad_token_id=0)  # fmt: skip
                theirs = theirs[0, len(p) :].tolist()
                same += sum(a == b for a, b in zip(mine, theirs, strict=True))
                total += len(theirs)
        out[arch] = {"tokens_equal": same, "tokens": total, "kv_groups": llm.engine.kv_groups.num_groups}
        log(f"  {arch:10s}: {same}/{total} greedy tokens equal to transformers' "
            f"({llm.engine.kv_groups.num_groups} KV groups)")  # fmt: skip
        del llm, hf
    with tempfile.TemporaryDirectory() as tmp:
        import transformers

        from prism_serve.engine.weights import load_hf_dir

        weights = load_hf_dir(write_synthetic_encoder(Path(tmp) / "bert", "bert", pooling="mean"))
        engine = LLMEngine(EngineConfig(dtype="float32", device=DEV), weights=weights)
        vocab = weights.config.vocab_size
        texts = [[t % vocab for t in p[:40]] for p in prompts[:8]]
        for i, ids in enumerate(texts):
            engine.add_request(ids, SamplingParams(max_tokens=1, pooling="mean"), f"e{i}")
        vectors = {}
        while engine.has_unfinished_requests():
            vectors.update({o.req_id: o.embedding for o in engine.step() if o.finished})
        hf = transformers.AutoModel.from_pretrained(Path(tmp) / "bert", dtype=torch.float32).to(DEV).eval()
        cos = []
        with torch.inference_mode():
            for i, ids in enumerate(texts):
                ref = hf(torch.tensor([ids], device=DEV)).last_hidden_state[0].mean(0).float().cpu()
                cos.append(float(torch.nn.functional.cosine_similarity(vectors[f"e{i}"].float(), ref, dim=0)))
        out["bert"] = {"min_cosine": min(cos)}
        log(f"  bert      : mean-pooled vectors, min cosine to transformers' {min(cos):.8f}")
    return out


def main() -> int:
    global DEV
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sections = "link,vmm,stridedkv,smollm,llama8b,pool8b,prefill,activation,hf,architectures"
    p.add_argument("--sections", default=sections)
    p.add_argument("--out", default=os.environ.get("OUT", "results/cuda"))
    p.add_argument("--device", default=DEV, help="cpu: the architectures section on the host")
    args = p.parse_args()
    DEV = args.device
    if DEV == "cpu":
        RESULTS["device"] = f"cpu (a check of the script), torch {torch.__version__}"
    else:
        props = torch.cuda.get_device_properties(0)
        RESULTS["device"] = (
            f"{props.name}, {props.total_memory / GiB:.0f} GiB, {props.multi_processor_count} SMs, "
            f"torch {torch.__version__}, CUDA {torch.version.cuda}"
        )
    log("device:", RESULTS["device"])
    failed = []
    for name in args.sections.split(","):
        log(f"== {name}")
        t0 = time.perf_counter()
        try:
            if name == "activation":
                RESULTS[name] = section_activation(RESULTS.get("link", {}).get("h2d_pinned_GBps"))
            else:
                RESULTS[name] = globals()[f"section_{name}"]()
        except Exception:
            traceback.print_exc()
            failed.append(name)
            RESULTS[name] = {"error": traceback.format_exc(limit=3)}
        log(f"   ({time.perf_counter() - t0:.1f} s)")
        if DEV != "cpu":
            torch.cuda.empty_cache()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "cuda_checks.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    log("failed sections:", failed or "none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
