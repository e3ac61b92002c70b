"""LoRA adapters made by ``peft`` over the real SmolLM2 (its GGUF's weights written as an HF
directory, fp32: the ``smollm_hf`` fixture), for the engine's and the server's adapter tests."""

from __future__ import annotations

import copy
import functools
from pathlib import Path

import torch


def make_adapter(
    base_dir: Path, path: Path, rank: int, alpha: float, targets: list[str], seed: int,
    rslora: bool = False, b_scale: float = 0.5,
) -> Path:  # fmt: skip
    """A PEFT LoRA adapter with random, non-zero A and B (a fresh LoRA's B is zero: a no-op), B
    scaled by ``b_scale`` so that it changes the greedy answer and keeps it text."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    cfg = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, init_lora_weights=False
    )
    peft_model = get_peft_model(model, cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.mul_(b_scale)
    peft_model.save_pretrained(path)
    return path


@functools.cache
def _base(base_dir: Path):
    """The base model read once per directory (each read takes seconds; a test reads it per adapter)."""
    from transformers import LlamaForCausalLM

    return LlamaForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32).eval()


def merged_greedy(base_dir: Path, adapter: Path | None, prompts: list[list[int]], n: int) -> list[list[int]]:
    """transformers (+ peft's merged adapter) in fp32, greedy, ``n`` tokens per prompt (EOS ignored)."""
    from peft import PeftModel

    model = copy.deepcopy(_base(base_dir))  # merging changes the weights in place
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:  # the prompt once, then one token a step over transformers' KV cache
            out = model(torch.tensor([ids]), use_cache=True, logits_to_keep=1)
            seq = [int(out.logits[0, -1].argmax())]
            while len(seq) < n:
                out = model(torch.tensor([seq[-1:]]), past_key_values=out.past_key_values, use_cache=True)
                seq.append(int(out.logits[0, -1].argmax()))
            outs.append(seq)
    return outs


def merged_texts(adapters: dict[str, Path], weights, prompt: str, n: int) -> dict[str, str]:
    """Each entry's greedy text for ``prompt`` (``n`` tokens): transformers over ``adapters["base"]``,
    with peft's adapter merged for every other entry; checked to differ (adapters that change
    nothing prove nothing)."""
    ids = weights.tokenizer.encode(prompt)
    out = {}
    for name, path in adapters.items():
        tokens = merged_greedy(adapters["base"], None if name == "base" else path, [ids], n)[0]
        out[name] = weights.tokenizer.decode(tokens)
    assert len(set(out.values())) == len(out), "adapters that change nothing prove nothing"
    return out
