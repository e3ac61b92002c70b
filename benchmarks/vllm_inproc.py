"""Child of vllm_activation.py, run by the vLLM environment's Python (``.venv-vllm-server``): vLLM's
engine in this process (no engine-core process, no API server), as a prism worker would hold it.

Times importing vLLM, building the engine over *dummy* weights (what a pooled worker would do once
per model shape), and each activation: ``reload_weights`` with the real weights from a safetensors
file (vLLM's in-place reload, which runs its weight post-processing again). Then the greedy tokens
of the given prompts; a second activation path, swapping in a model's state captured in vLLM's
kernel format (``capture`` / ``swap``), between the real model and a perturbed copy, each swap
checked by its greedy outputs; and, for comparison, the same engine built over the real weights
directly (the cold in-process start). Prints one JSON object on the last line.

    .venv-vllm-server/bin/python benchmarks/vllm_inproc.py HF_DIR PROMPTS_JSON [--reloads 5]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def engine(path: str, load_format: str):
    from vllm import EngineArgs
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(
        model=path, dtype="float32", enforce_eager=True, load_format=load_format, max_model_len=2048,
        max_num_seqs=32, enable_prefix_caching=False,
    )  # fmt: skip
    return LLMEngine.from_engine_args(args)


def model_runner(eng):
    """The in-process model runner (engine core -> executor -> worker -> runner)."""
    return eng.engine_core.engine_core.model_executor.driver_worker.worker.model_runner


def real_weights(path: str) -> dict:
    """The checkpoint's tensors; a tied LM head gets the embedding (a dummy-built engine keeps its
    own random LM head otherwise: vLLM's reload finds no ``lm_head.weight`` in such a checkpoint)."""
    from safetensors.torch import load_file

    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    sd: dict = {}
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            sd.update(load_file(os.path.join(path, name)))
    if config.get("tie_word_embeddings") and "lm_head.weight" not in sd:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    return sd


def capture(model) -> dict:
    """The model's state in vLLM's kernel format: per module its ``cpu_linear`` (the closure over the
    packed weight that CPU post-processing made) and copies of its non-empty parameters and
    buffers. Taken once per model after a reload, it is what a host cache would keep."""
    state = {}
    for name, m in model.named_modules():
        entry = {}
        if hasattr(m, "cpu_linear"):
            entry["cpu_linear"] = m.cpu_linear
        for pn, p in m.named_parameters(recurse=False):
            entry[pn] = p.data.clone() if p.numel() else p.data
        for bn, b in m.named_buffers(recurse=False):
            entry["buffer:" + bn] = b.clone()
        if entry:
            state[name] = entry
    return state


def swap(model, state: dict) -> None:
    """Activate a captured state: closures and parameter data by reference, buffers copied."""
    modules = dict(model.named_modules())
    for name, entry in state.items():
        m = modules[name]
        for key, value in entry.items():
            if key == "cpu_linear":
                m.cpu_linear = value
            elif key.startswith("buffer:"):
                getattr(m, key.removeprefix("buffer:")).copy_(value)
            else:
                getattr(m, key).data = value


def greedy(eng, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    from vllm import SamplingParams

    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, ids in enumerate(prompts):
        eng.add_request(f"r{time.monotonic_ns()}-{i}", {"prompt_token_ids": ids}, sp)
    out: dict[str, list[int]] = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[k] for k in sorted(out, key=lambda k: int(k.rsplit("-", 1)[1]))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model_dir")
    ap.add_argument("prompts", help="JSON file: a list of token id lists")
    ap.add_argument("--reloads", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=16)
    args = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process
    with open(args.prompts) as f:
        prompts = json.load(f)
    t0 = time.perf_counter()
    import vllm

    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng = engine(args.model_dir, "dummy")
    init_s = time.perf_counter() - t0
    runner = model_runner(eng)
    t0 = time.perf_counter()
    sd = real_weights(args.model_dir)
    read_s = time.perf_counter() - t0
    reloads = []
    for _ in range(args.reloads):
        t0 = time.perf_counter()
        runner.reload_weights(weights_iterator=iter(sd.items()), is_checkpoint_format=True)
        reloads.append(time.perf_counter() - t0)
    tokens = greedy(eng, prompts, args.max_tokens)
    # the packed-state swap: capture the real model's kernel-format state and a second model's
    # (the real weights perturbed), then switch between them; each must give its own outputs
    import torch

    model = runner.get_model()
    real = capture(model)
    gen = torch.Generator().manual_seed(0)
    other_sd = {k: v + 0.02 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.dim() == 2 else v
                for k, v in sd.items()}  # fmt: skip
    runner.reload_weights(weights_iterator=iter(other_sd.items()), is_checkpoint_format=True)
    other_tokens = greedy(eng, prompts, args.max_tokens)
    other = capture(model)
    swaps, swap_ok = [], []
    for _ in range(args.reloads):
        for state, expected in ((real, tokens), (other, other_tokens)):
            t0 = time.perf_counter()
            swap(model, state)
            swaps.append(time.perf_counter() - t0)
            swap_ok.append(greedy(eng, prompts, args.max_tokens) == expected)
    del eng, runner, model, real, other
    t0 = time.perf_counter()
    cold = engine(args.model_dir, "safetensors")
    cold_s = time.perf_counter() - t0
    cold_tokens = greedy(cold, prompts, args.max_tokens)
    result = {
        "vllm": vllm.__version__, "import_s": import_s, "init_dummy_s": init_s, "read_s": read_s,
        "reload_s": reloads, "tokens": tokens, "cold_init_s": cold_s, "cold_tokens": cold_tokens,
        "swap_s": swaps, "swap_outputs_right": sum(swap_ok), "swaps": len(swap_ok),
        "other_differs": other_tokens != tokens,
    }  # fmt: skip
    print(json.dumps(result), flush=True)
    sys.stdout.flush()
    os._exit(0)  # vLLM's in-process engine core leaves threads that delay a normal exit


if __name__ == "__main__":
    main()
