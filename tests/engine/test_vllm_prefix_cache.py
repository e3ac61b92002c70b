"""vLLM's automatic prefix caching under prism's elastic KV (engine/vllm_engine.py): with vLLM's
real CPU build (the environment scripts/vllm-server-env.sh makes) and the real SmolLM2-135M
weights in fp32, one ``VllmEngine`` built the way a worker builds it, its KV buffer on host pages
granted by a device ledger of the test's own.

Checked in one vLLM process (eager):
- the same 400-token prompt twice: the second finds its 3 full blocks of 128 tokens in the cache
  (``num_cached_tokens``) and decodes the same greedy tokens;
- idle, the engine keeps the cached blocks' pages mapped and tells the ledger they are reclaimable;
- another account's grant refused for lack of budget asks for memory back: the engine gives back
  what was asked by lowering the watermark, evicting the cached blocks above it from vLLM's prefix
  cache first; the blocks below it still hit, and the output is the same; asked for everything,
  it keeps only the null block's pages and the cache is empty, and the output is still the same;
- a request with prompt logprobs reads nothing from the cache;
- loading weights empties the cache."""

from __future__ import annotations

from pathlib import Path

from tests.engine.vllm_script import run_vllm_script

SCRIPT = r"""
import json, os, sys, uuid
from prism_serve.engine.vllm_engine import vllm_environment
vllm_environment()
os.environ.update(VLLM_LOGGING_LEVEL="ERROR")
from safetensors.torch import load_file
from tokenizers import Tokenizer
from prism_serve.engine.config import EngineConfig
from prism_serve.engine.sampling_params import SamplingParams
from prism_serve.engine.vllm_engine import VllmEngine
from prism_serve.memory.ledger import DeviceLedger
from prism_serve.memory.vmm import HostVirtualRange

hf = sys.argv[1]
MiB = 2**20
ledger = DeviceLedger("cpu:0", 2048 * MiB, namespace=f"test{uuid.uuid4().hex[:12]}")
out = {}
try:
    kv_account = ledger.account("m kv")
    # 64 KiB pages: a 128-token block of one layer (192 KiB) spans whole pages, so each block's
    # pages can go on their own
    kv_range = HostVirtualRange("cpu:0", 256 * MiB, 64 * 1024)
    config = EngineConfig(model=hf, dtype="float32", max_model_len=1024, max_num_seqs=4)
    engine = VllmEngine.build(hf, config, kv_range, kv_account)
    real = load_file(os.path.join(hf, "model.safetensors"))
    engine.load(real)
    text = open(os.path.join(hf, "config.json")).read() * 8
    prompt = Tokenizer.from_file(os.path.join(hf, "tokenizer.json")).encode(text).ids[:400]
    n = 0

    def run(**kw):
        global n
        n += 1
        engine.add_request(prompt, SamplingParams(max_tokens=8, temperature=0, **kw), f"r{n}")
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    done = o
        engine.shrink_idle()  # what the worker does when its engine has no request left
        return {"tokens": done.token_ids, "cached": done.num_cached_tokens}

    def entry():
        e = kv_account.entry()
        return {"mapped": e.mapped_bytes, "reclaimable": e.reclaimable_bytes}

    null_pages = engine.kv.bytes_for(1)
    out["block_size"] = engine.block_size
    out["first"] = run()
    out["second"] = run()
    out["idle"] = {**entry(), "null": null_pages, "cached_blocks": engine.num_cached_blocks,
                   "watermark": engine.kv.watermark, "used": engine.num_used_blocks}
    # another model's grant, refused: the device is short by about half of the cached pages
    other = ledger.account("other kv")
    snap = ledger.snapshot()
    free = snap.budget_bytes - snap.used_bytes
    want = free + entry()["reclaimable"] // 2
    out["refused"] = not other.try_reserve(want)
    out["asked"] = ledger.reclaim_wanted()
    given = engine.give_back_cached(ledger.reclaim_wanted())  # what the worker's poll does
    out["after_half"] = {**entry(), "given": given, "cached_blocks": engine.num_cached_blocks,
                         "watermark": engine.kv.watermark, "asked_now": ledger.reclaim_wanted()}
    out["granted"] = other.try_reserve(want)
    other.release(want)
    out["third"] = run()
    num_cached = engine.num_cached_blocks
    out["drop_one"] = [engine.drop_cached(1), num_cached - engine.num_cached_blocks]
    given = engine.give_back_cached(entry()["mapped"])  # everything it can
    out["after_all"] = {**entry(), "given": given, "cached_blocks": engine.num_cached_blocks,
                        "watermark": engine.kv.watermark}
    out["fourth"] = run()
    out["prompt_logprobs"] = run(prompt_logprobs=1)
    out["before_load"] = engine.num_cached_blocks
    engine.load(real)
    out["after_load"] = engine.num_cached_blocks
    out["fifth"] = run()
    engine.close()
    engine.kv.close()
    out["closed"] = entry()
finally:
    ledger.close()
    ledger.unlink()
print("RESULT " + json.dumps(out))
"""


def test_cached_prompts_match_and_cached_pages_go_back_first(smollm_hf: Path) -> None:
    out = run_vllm_script(SCRIPT, str(smollm_hf))
    bs = out["block_size"]
    full = 399 // bs  # the last prompt token is always computed
    first = out["first"]
    assert first["cached"] == 0 and len(first["tokens"]) == 8
    assert out["second"] == {"tokens": first["tokens"], "cached": full * bs}
    # idle: no block in use; the prompt's full blocks (and the ones its two requests wrote after
    # them, as each request's last block filled) stay cached, their pages mapped and reclaimable
    idle = out["idle"]
    assert idle["used"] == 0 and idle["cached_blocks"] >= full
    assert idle["reclaimable"] == idle["mapped"] - idle["null"] > 0
    # half of that asked back: the watermark came down, the cached blocks above it were evicted
    assert out["refused"] and out["asked"] > 0
    half = out["after_half"]
    assert half["given"] >= out["asked"] and half["asked_now"] == 0 and out["granted"]
    assert 1 < half["watermark"] < idle["watermark"] and 0 < half["cached_blocks"] < idle["cached_blocks"]
    assert half["reclaimable"] == half["mapped"] - idle["null"]
    third = out["third"]  # the blocks below the watermark still hit; those above were recomputed
    assert third["tokens"] == first["tokens"] and 0 < third["cached"] < full * bs
    assert out["drop_one"] == [1, 1]  # the worker interface's drop: the highest cached block
    gone = out["after_all"]
    assert gone["cached_blocks"] == 0 and gone["watermark"] == 1
    assert gone["mapped"] == idle["null"] and gone["reclaimable"] == 0
    assert out["fourth"] == {"tokens": first["tokens"], "cached": 0}  # nothing left to match
    assert out["prompt_logprobs"] == {"tokens": first["tokens"], "cached": 0}  # vLLM skips the cache
    assert out["before_load"] > 0 and out["after_load"] == 0  # other weights: nothing may match
    assert out["fifth"] == {"tokens": first["tokens"], "cached": 0}
    assert out["closed"] == {"mapped": 0, "reclaimable": 0}
