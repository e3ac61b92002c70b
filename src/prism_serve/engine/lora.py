"""LoRA adapters over a base model, batched together: PEFT's files read and checked against the
base's shape, the adapters in use held in slots beside the base's weights, and a batch whose rows
belong to different adapters (or to none) run through each linear layer once, every row then
adding its own adapter's low-rank update.

An adapter (PEFT's ``adapter_config.json`` + ``adapter_model.safetensors``) changes a base linear
layer ``y = x W^T`` into ``y = x W^T + s (x A^T) B^T`` with ``A`` [r, in], ``B`` [out, r] and the
scale ``s = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA), for any of the decoder's seven
projections (q, k, v, o, gate, up, down). The base model fuses q/k/v and gate/up into one matmul
each; an adapter's module writes into its columns of the fused output.

``LoraSlots`` holds ``num_slots`` adapters per module as ``A`` [slots, max_rank, in] (the scale
folded in) and ``B`` [slots, max_rank, out], each with its own rank, so that a rank-r adapter costs
r, not the largest rank, and a module the adapter does not name costs nothing. Loading an adapter
into a slot is a copy. ``apply`` adds the updates of a batch's rows: the CPU kernel
(``csrc/lora.cpp``) reads each row's adapter in place, so the work is the rows' own ranks and
nothing grows with the number of adapters in the batch; elsewhere (torch ops, a CUDA device) the
rows are grouped by adapter and each group is two matmuls.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.sources import json_object
from prism_serve.errors import ConflictError, InvalidRequestError, quoted

__all__ = [
    "MODULES",
    "AdapterInUseError",
    "AdapterSlots",
    "InvalidAdapterError",
    "LoraAdapter",
    "LoraRows",
    "LoraSlots",
    "read_adapter",
]

# each adapter module: the base model's fused linear it belongs to, and its place in that output
MODULES = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o_proj",
    "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
}  # fmt: skip
_UNSUPPORTED = {
    "use_dora": "DoRA adapters",
    "modules_to_save": "adapters that replace whole modules (modules_to_save)",
    "layer_replication": "layer replication",
    "fan_in_fan_out": "fan_in_fan_out (GPT-2 style Conv1D weights)",
}
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.[\w-]+)?\.weight$")


class InvalidAdapterError(InvalidRequestError):
    """An adapter that cannot be served on its base: its files are missing or unreadable, it is
    for another shape, its rank is above the base's limit, or it uses a feature not supported."""

    code = "invalid_adapter"


def column_offsets(config: ArchConfig) -> dict[str, int]:
    """Where each module's output starts in its fused linear's output (MODULES' order within each)."""
    shapes, at, out = config.projection_shapes(), {}, {}
    for module, fused in MODULES.items():
        out[module] = at.get(fused, 0)
        at[fused] = out[module] + shapes[module][1]
    return out


@dataclass
class LoraAdapter:
    """One adapter's weights, read and checked: per (layer, module) ``A`` [r, in] with the scale
    folded in and ``B`` [out, r], in float32."""

    name: str
    path: str
    rank: int  # the largest rank of its modules
    target_modules: tuple[str, ...]
    # read from its files, or views of the runtime's host cache made when read (runtime/adapters.py)
    weights: Mapping[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(repr=False)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _pattern_value(patterns: dict, module_path: str, default):
    """PEFT's rank_pattern / alpha_pattern: the value of the first key that names this module (a
    regular expression over its dotted path, or a suffix of it)."""
    for key, value in (patterns or {}).items():
        try:
            named = re.fullmatch(f".*\\.{key}", module_path) is not None
        except re.error:
            named = False
        if module_path == key or module_path.endswith("." + key) or named:
            return value
    return default


def read_adapter(path: str | Path, config: ArchConfig, max_rank: int, name: str | None = None) -> LoraAdapter:
    """The PEFT LoRA adapter in directory ``path`` for a base of ``config``'s shape;
    InvalidAdapterError naming the adapter and what is wrong otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = Path(path)
    name = name or path.name
    where = f"adapter {quoted(name)} ({quoted(str(path))})"
    cfg_file = path / "adapter_config.json"
    try:
        found = cfg_file.is_file()
    except (OSError, ValueError):  # a path the OS cannot take (a NUL byte, too long)
        found = False
    if not found:
        raise InvalidAdapterError(f"{where}: no adapter_config.json (a PEFT LoRA directory is expected)")
    cfg = json_object(cfg_file, InvalidAdapterError)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise InvalidAdapterError(
            f"{where}: peft_type {cfg.get('peft_type')!r}; only LORA adapters are served"
        )
    for key, what in _UNSUPPORTED.items():
        if cfg.get(key):
            raise InvalidAdapterError(f"{where}: {what} are not supported")
    if cfg.get("bias", "none") != "none" or cfg.get("lora_bias"):
        raise InvalidAdapterError(f"{where}: adapters with bias terms are not supported")
    try:
        rank_default = int(cfg["r"])
        alpha_default = float(cfg.get("lora_alpha", rank_default))
    except (KeyError, TypeError, ValueError):
        raise InvalidAdapterError(f"{where}: adapter_config.json needs an integer r") from None
    rslora = bool(cfg.get("use_rslora"))

    files = sorted(path.glob("*.safetensors"))
    if not files:
        bins = list(path.glob("adapter_model.bin"))
        hint = " (adapter_model.bin found: save it with safe_serialization=True)" if bins else ""
        raise InvalidAdapterError(f"{where}: no adapter_model.safetensors{hint}")
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise InvalidAdapterError(f"{where}: cannot read {f.name}: {e}") from None

    shapes = config.projection_shapes()
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.search(key)
        if m is None:
            raise InvalidAdapterError(
                f"{where}: tensor {quoted(key)} is not a LoRA weight of a decoder projection"
            )
        layer, module, half = int(m.group(1)), m.group(2), m.group(3)
        if module not in MODULES:
            raise InvalidAdapterError(f"{where}: module {module!r} is not one of {', '.join(MODULES)}")
        if layer >= config.num_layers:
            raise InvalidAdapterError(
                f"{where}: weights for layer {layer}, the base has {config.num_layers} layers"
            )
        halves.setdefault((layer, module), {})[half] = t
    if not halves:
        raise InvalidAdapterError(f"{where}: no LoRA weights in its safetensors files")

    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    top = 0
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise InvalidAdapterError(f"{where}: layer {layer} {module} has lora_{''.join(pair)} only")
        a, b = pair["A"], pair["B"]
        fan_in, fan_out = shapes[module]
        r = a.shape[0] if a.dim() == 2 else -1
        if r < 1 or b.dim() != 2 or a.shape[1] != fan_in or b.shape != (fan_out, r):
            raise InvalidAdapterError(
                f"{where}: layer {layer} {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; a base of "
                f"this shape needs A [r, {fan_in}] and B [{fan_out}, r] (an adapter for another base?)"
            )
        if r > max_rank:
            raise InvalidAdapterError(f"{where}: rank {r} is above this base's max_lora_rank {max_rank}")
        module_path = f"model.layers.{layer}.{'self_attn' if module[0] in 'qkvo' else 'mlp'}.{module}"
        alpha = float(_pattern_value(cfg.get("alpha_pattern"), module_path, alpha_default))
        scale = alpha / math.sqrt(r) if rslora else alpha / r  # r >= 1: checked above
        weights[layer, module] = ((a.float() * scale).contiguous(), b.float().contiguous())
        top = max(top, r)
    targets = tuple(sorted({m for _, m in weights}, key=list(MODULES).index))
    return LoraAdapter(name, str(path), top, targets, weights)


@dataclass
class LoraRows:
    """Which slot each row (token) of a forward pass uses: ``slots`` [T] int64, -1 for the base;
    ``kernel``: through the CPU kernel (the runner's one decision, AttentionMetadata.kernels)."""

    slots: torch.Tensor
    lora: LoraSlots
    kernel: bool

    def apply(self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor) -> None:
        self.lora.apply(layer, fused, x, y, self.slots, self.kernel)


class LoraSlots:
    """``num_slots`` adapters resident beside a base model, per layer and module:
    ``A`` [slots, max_rank, in] (scale folded in) and ``B`` [slots, max_rank, out], and each slot's
    rank per module (0 where its adapter has none)."""

    def __init__(
        self, config: ArchConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
        device: torch.device | str = "cpu", storage: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """``storage``: memory to lay the slots out in (uint8, at least ``bytes_for`` long: the
        runtime's weight pages, granted from the device ledger with the base's weights); it is
        zeroed here. None: fresh tensors."""
        self.config, self.num_slots, self.max_rank, self.dtype = config, num_slots, max_rank, dtype
        self.offsets = column_offsets(config)
        layout = self._layout(config, num_slots, max_rank)
        if storage is None:
            storage = torch.zeros(self.bytes_for(config, num_slots, max_rank, dtype), dtype=torch.uint8,
                                  device=device)  # fmt: skip
        else:
            storage[: self.bytes_for(config, num_slots, max_rank, dtype)].zero_()
        size = dtype.itemsize
        self.a, self.b = {}, {}
        for (kind, layer, module), (start, shape) in layout.items():
            n = math.prod(shape)
            view = storage[start * size : (start + n) * size].view(dtype).view(shape)
            (self.a if kind == "a" else self.b)[layer, module] = view
        # [layers, modules, slots] int64: each slot's rank per module (on the host: the kernel reads it)
        self.ranks = torch.zeros(config.num_layers, len(MODULES), num_slots, dtype=torch.int64)
        self.names: list[str | None] = [None] * num_slots
        self._fused = {f: [m for m in MODULES if MODULES[m] == f] for f in set(MODULES.values())}
        self._index = {m: j for j, m in enumerate(MODULES)}

    @staticmethod
    def _layout(config: ArchConfig, num_slots: int, max_rank: int) -> dict[tuple, tuple[int, tuple]]:
        """(``a``/``b``, layer, module) -> (element offset, shape) of each stacked tensor."""
        shapes = config.projection_shapes()
        out, at = {}, 0
        for layer in range(config.num_layers):
            for m in MODULES:
                for kind, width in (("a", shapes[m][0]), ("b", shapes[m][1])):
                    out[kind, layer, m] = (at, (num_slots, max_rank, width))
                    at += num_slots * max_rank * width
        return out

    @classmethod
    def bytes_for(cls, config: ArchConfig, num_slots: int, max_rank: int, dtype: torch.dtype) -> int:
        """The memory ``num_slots`` slots of rank ``max_rank`` take beside a base of ``config``."""
        return num_slots * max_rank * config.lora_params_per_rank() * dtype.itemsize

    def load(self, slot: int, adapter: LoraAdapter) -> None:
        """Copy ``adapter`` into ``slot`` (in place of what was there). Only each module's first
        ``rank`` rows of A and B are ever read (the kernels and the grouped ops stop at the slot's
        rank), so what a previous adapter left beyond them is not cleared."""
        if adapter.rank > self.max_rank:
            raise InvalidAdapterError(f"adapter {adapter.name!r}: rank {adapter.rank} > {self.max_rank}")
        ranks = torch.zeros(self.config.num_layers, len(MODULES), dtype=torch.int64)
        for (layer, module), (a, b) in adapter.weights.items():
            r = a.shape[0]
            self.a[layer, module][slot, :r].copy_(a)
            self.b[layer, module][slot, :r].copy_(b.t())
            ranks[layer, self._index[module]] = r
        self.ranks[:, :, slot] = ranks
        self.names[slot] = adapter.name

    def clear(self, slot: int) -> None:
        """The slot holds no adapter (rank 0 everywhere: nothing of it is read)."""
        self.ranks[:, :, slot] = 0
        self.names[slot] = None

    def apply(
        self, layer: int, fused: str, x: torch.Tensor, y: torch.Tensor, slots: torch.Tensor, kernel: bool
    ) -> None:
        """``y`` (the fused linear's output for input ``x``) += each row's adapter update, through
        the CPU kernel with ``kernel``, the Triton kernels on a CUDA device, else grouped torch ops."""
        from prism_serve.engine import cpu_kernels, cuda_kernels

        triton = y.is_cuda and cuda_kernels.triton is not None

        for module in self._fused[fused]:
            ranks = self.ranks[layer, self._index[module]]
            a, b = self.a[layer, module], self.b[layer, module]
            start = self.offsets[module]
            out = y.narrow(-1, start, b.shape[2])
            if kernel:
                cpu_kernels.lora_apply(x, out, a, b, slots, ranks)
            elif triton:
                cuda_kernels.lora_apply(x, out, a, b, slots, ranks)
            else:
                _apply_grouped(x, out, a, b, slots, ranks)


def _apply_grouped(
    x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, slots: torch.Tensor,
    ranks: torch.Tensor,
) -> None:  # fmt: skip
    """The rows of each slot in the batch together: two matmuls per slot (torch ops)."""
    for s in torch.unique(slots).tolist():
        r = int(ranks[s]) if s >= 0 else 0
        if r == 0:
            continue
        rows = (slots == s).nonzero().squeeze(1)
        update = (x.index_select(0, rows) @ a[s, :r].t()) @ b[s, :r]
        out.index_add_(0, rows, update.to(out.dtype))


class AdapterInUseError(ConflictError):
    """An adapter cannot be removed while requests use it (abort them, or remove with force)."""

    code = "adapter_in_use"


class AdapterSlots:
    """The adapters an engine can serve and the slots they run from. A request's adapter takes a
    slot when the scheduler admits it (``acquire``: a copy into the slot if it is not there) and
    holds it until the request finishes or is preempted (``release``). A slot no request holds
    is reused for another adapter, least recently used first; an adapter that finds no free slot
    waits (its request stays queued) while requests of other adapters go on."""

    def __init__(self, slots: LoraSlots) -> None:
        self.slots = slots
        self.adapters: dict[str, LoraAdapter] = {}
        self._refs = [0] * slots.num_slots
        self._used = [0] * slots.num_slots  # when each slot was last taken (a counter)
        self._clock = 0
        self.loads = 0  # copies into a slot so far

    def register(self, adapter: LoraAdapter) -> None:
        if adapter.rank > self.slots.max_rank:
            raise InvalidAdapterError(
                f"adapter {adapter.name!r}: rank {adapter.rank} is above max_lora_rank {self.slots.max_rank}"
            )
        self.adapters[adapter.name] = adapter

    def unregister(self, name: str) -> None:
        """Forget ``name``; AdapterInUseError if a request holds its slot."""
        slot = self.slot_of(name)
        if slot is not None and self._refs[slot]:
            raise AdapterInUseError(f"adapter {name!r} has {self._refs[slot]} requests running")
        if slot is not None:
            self.slots.clear(slot)
        self.adapters.pop(name, None)

    def slot_of(self, name: str) -> int | None:
        try:
            return self.slots.names.index(name)
        except ValueError:
            return None

    def acquire(self, seq) -> bool:  # seq: engine.sequence.Sequence
        """Give ``seq``'s adapter a slot (True), or say it must wait for one (False)."""
        if seq.adapter is None or seq.lora_slot is not None:
            return True
        slot = self.slot_of(seq.adapter)
        if slot is None:
            free = [s for s in range(self.slots.num_slots) if self._refs[s] == 0]
            if not free:
                return False
            slot = min(free, key=lambda s: (self.slots.names[s] is not None, self._used[s]))
            adapter = self.adapters.get(seq.adapter)
            if adapter is None:  # removed while the request waited
                raise InvalidAdapterError(f"adapter {seq.adapter!r} is not registered")
            self.slots.load(slot, adapter)
            self.loads += 1
        self._refs[slot] += 1
        self._clock += 1
        self._used[slot] = self._clock
        seq.lora_slot = slot
        return True

    def release(self, seq) -> None:
        if seq.lora_slot is not None:
            self._refs[seq.lora_slot] -= 1
            seq.lora_slot = None

    def rows(self, scheduled, device: torch.device, kernel: bool) -> LoraRows | None:
        """Each new token's slot for a step of ``scheduled`` (ScheduledSeq, in batch order), on
        ``device``; None when no row uses an adapter."""
        if not any(s.seq.lora_slot is not None for s in scheduled):
            return None
        slots = []
        for s in scheduled:
            slot = -1 if s.seq.lora_slot is None else s.seq.lora_slot
            slots.extend([slot] * s.num_new_tokens)
        return LoraRows(torch.tensor(slots, dtype=torch.int64, device=device), self.slots, kernel)
