"""A checkpoint into a built vLLM engine without vLLM's layer-by-layer reload.

vLLM's ``reload_weights`` (what ``VllmEngine.load`` falls back to) restores every layer's original
parameters, copies each checkpoint tensor in through the model's weight loaders, then runs each
layer's post-processing, which on CPU packs every linear layer's weight into oneDNN's format. For
SmolLM2-135M here that is about 0.45 s, of which the packing is 0.17 s and the copies 0.10 s.

A ``LoadPlan`` does only what the result needs: each data parameter (embeddings, norms, biases, all
in the worker's weight range) is copied from its checkpoint tensor, or from its shards' tensors
stacked (a fused QKV bias from q, k and v); each packed linear is repacked by vLLM's own
post-processing straight from its checkpoint tensor, a view of prism's host cache file (its shards
stacked first: a fused QKV or gate-up weight), with no copy into a parameter first. Which
checkpoint names make which parameter comes from the parameter's own name, else from the model's
``packed_modules_mapping`` (the fused layers vLLM declares for each architecture).

A plan is used only once it has been checked on this engine: ``verify`` loads the same tensors
both ways and requires every data parameter to be equal and every packed linear to give the same
outputs on random inputs. A model whose loader transforms tensors on the way (a reordering, a
scale, a renamed prefix), a quantized or mixture-of-experts model, or a name the plan cannot place
fails that check or gets no plan, and loads through vLLM's reload as before.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from prism_serve.engine.weights import CHECKPOINT_FLOATS

__all__ = ["LoadPlan", "checkpoint_signature", "make_plan", "synthetic_checkpoint", "unused_layer", "verify"]

_UNQUANTIZED = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")
_IGNORED = ("rotary_emb.inv_freq",)  # computed by vLLM, present in some checkpoints

Signature = frozenset[tuple[str, tuple[int, ...], torch.dtype]]


def checkpoint_signature(named: dict[str, torch.Tensor]) -> Signature:
    """What a plan depends on: every tensor's name, shape and dtype (fine-tunes of one base share it)."""
    return frozenset((n, tuple(t.shape), t.dtype) for n, t in named.items())


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """By name (a reload may give a layer new parameter objects; the names stay)."""

    # each data parameter and the checkpoint names stacked (dim 0) into it
    params: tuple[tuple[str, tuple[str, ...]], ...]
    # each packed linear and the names stacked into its weight; () repacks its own weight, a data
    # parameter above (a tied LM head's, the embedding)
    linears: tuple[tuple[str, tuple[str, ...]], ...]

    def parameters(self, model: torch.nn.Module) -> list[torch.nn.Parameter]:
        by_name = dict(model.named_parameters())
        return [by_name[n] for n, _ in self.params]

    def modules(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        by_name = dict(model.named_modules())
        return [by_name[n] for n, _ in self.linears]

    def apply(self, model: torch.nn.Module, named: dict[str, torch.Tensor]) -> None:
        for p, (_, names) in zip(self.parameters(model), self.params, strict=True):
            row = 0
            for n in names:  # each shard into its rows (the parameter may be on another device)
                t = named[n]
                p.data[row : row + t.shape[0]].copy_(t)
                row += t.shape[0]
        for m, (_, names) in zip(self.modules(model), self.linears, strict=True):
            if names:
                m.weight = torch.nn.Parameter(stacked([named[n] for n in names]), requires_grad=False)
            m.quant_method.process_weights_after_loading(m)  # packs it, and drops that weight


def stacked(shards: list[torch.Tensor]) -> torch.Tensor:
    """The shards stacked along dim 0: a view when they lie back to back in one buffer (prism's
    host cache keeps the usual ones so, runtime/weight_cache.shards_together), else a copy."""
    first = shards[0]
    if len(shards) == 1:
        return first
    at, rows = first.data_ptr(), 0
    for t in shards:
        if not (t.is_contiguous() and t.dtype == first.dtype and t.shape[1:] == first.shape[1:]):
            return torch.cat(shards)
        if t.data_ptr() != at or t.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return torch.cat(shards)
        at += t.numel() * t.element_size()
        rows += t.shape[0]
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def make_plan(model: torch.nn.Module, named: dict[str, torch.Tensor], tied_head: bool) -> LoadPlan | None:
    """The plan for loading ``named`` (checkpoint names) into ``model``, or None where some
    parameter or tensor has no place in one (then vLLM's reload loads it)."""
    fused = getattr(model, "packed_modules_mapping", None) or {}

    def sources(name: str, rows: int, rest: tuple[int, ...]) -> tuple[str, ...] | None:
        t = named.get(name)
        if t is not None:
            return (name,) if tuple(t.shape) == (rows, *rest) else None
        module, _, leaf = name.rpartition(".")
        parent, _, last = module.rpartition(".")
        shards = fused.get(last)
        if not shards:
            return None
        out = tuple(f"{parent}.{s}.{leaf}" if parent else f"{s}.{leaf}" for s in shards)
        ts = [named.get(n) for n in out]
        if any(t is None or tuple(t.shape[1:]) != rest for t in ts):
            return None
        return out if sum(t.shape[0] for t in ts) == rows else None

    params, seen = [], set()
    for name, p in model.named_parameters():
        if not p.numel() or id(p) in seen:
            continue
        seen.add(id(p))
        src = sources(name, p.shape[0], tuple(p.shape[1:])) if p.dim() else None
        if src is None:
            return None
        params.append((name, src))
    linears = []
    for name, m in model.named_modules():
        if unused_layer(m):
            continue
        method = getattr(m, "quant_method", None)
        own = [p for p in m.parameters(recurse=False) if p.numel()]
        if method is not None and own and type(method).__name__ not in _UNQUANTIZED:
            return None  # quantized weights: vLLM's own loader
        if not hasattr(m, "cpu_linear"):
            continue
        if type(method).__name__ not in _UNQUANTIZED or _input_size(m) is None:
            return None
        if m.weight.numel():
            linears.append((name, ()))  # repacked from its own weight, a data parameter
            continue
        # a ReplicatedLinear (a classifier's score head) names its sizes without the partition
        rows = getattr(m, "output_size_per_partition", None) or getattr(m, "output_size", None)
        src = sources(f"{name}.weight", rows, (_input_size(m),)) if rows else None
        if src is None:
            return None
        linears.append((name, src))
    used = {n for _, src in (*params, *linears) for n in src}
    left = {n for n in named if n not in used and not n.endswith(_IGNORED)}
    if tied_head:
        left.discard("lm_head.weight")  # the embedding's, which the plan loads already
    return LoadPlan(tuple(params), tuple(linears)) if not left else None


def unused_layer(m: torch.nn.Module) -> bool:
    """vLLM's stand-in for a layer the model keeps but never calls (``StageMissingLayer``: a
    pooling model's LM head, converted away); the real layer is its ``module``."""
    return type(m).__name__ == "StageMissingLayer"


def _input_size(m: torch.nn.Module) -> int | None:
    return (
        getattr(m, "input_size_per_partition", None)
        or getattr(m, "embedding_dim", None)
        or getattr(m, "input_size", None)
    )


def verify(
    plan: LoadPlan,
    model: torch.nn.Module,
    named: dict[str, torch.Tensor],
    reload: Callable[[], None],
    dtype: torch.dtype,
) -> bool:
    """Load ``named`` with vLLM's ``reload``, then with ``plan``: True when every data parameter is
    equal and every packed linear gives the same outputs for random inputs, and no linear's weight
    still points into the checkpoint's memory. Either way the model ends up holding ``named``."""
    reload()
    gen = torch.Generator().manual_seed(0)
    probes = []
    for m in plan.modules(model):
        x = torch.randn(3, _input_size(m), generator=gen).to(dtype)
        probes.append((x, m.cpu_linear(x, m.weight, None)))
    want = [p.detach().clone() for p in plan.parameters(model)]
    plan.apply(model, named)
    same = all(torch.equal(p, w) for p, w in zip(plan.parameters(model), want, strict=True))
    for m, (_, names), (x, y) in zip(plan.modules(model), plan.linears, probes, strict=True):
        out = m.cpu_linear(x, m.weight, None)
        same = same and (not names or m.weight.numel() == 0) and torch.equal(out, y)
    if not same:
        reload()  # whatever the plan did, vLLM's own load is what the model holds
    return same


def synthetic_checkpoint(source: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors with the names, shapes and dtypes prism's host cache will hold for ``source``'s
    safetensors (floating ones in ``dtype``, as engine/weights.load_checkpoint casts them), each
    with other values (views of one random buffer at different offsets: the largest tensor's size,
    not the checkpoint's), read from the files' headers only."""
    from safetensors import safe_open

    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
    for f in sorted(Path(source).glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():  # noqa: SIM118 (safe_open has no __iter__)
                s = st.get_slice(k)
                t_dtype = getattr(torch, _DTYPE_NAMES.get(s.get_dtype(), "uint8"))
                shapes[k] = (tuple(s.get_shape()), dtype if t_dtype in CHECKPOINT_FLOATS else t_dtype)
    if not shapes:
        return {}
    largest = max(math.prod(s) for s, _ in shapes.values())
    pool = torch.randn(largest + len(shapes), generator=torch.Generator().manual_seed(1)).to(dtype)
    return {
        k: pool[i : i + math.prod(shape)].view(shape) if dt == dtype else torch.zeros(shape, dtype=dt)
        for i, (k, (shape, dt)) in enumerate(shapes.items())
    }


_DTYPE_NAMES = {
    "F32": "float32", "F16": "float16", "BF16": "bfloat16", "F64": "float64",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}  # fmt: skip
