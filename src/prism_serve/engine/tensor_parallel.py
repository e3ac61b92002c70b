"""Tensor parallelism for the built-in engine: one model's decoder split over N ranks (processes),
each with its own engine over its shard, the ranks joined by all-reduces.

A rank's shard (``shard_weights``), for a Llama-shaped decoder:

- attention by heads: each rank takes a contiguous group of KV heads (as evenly as possible: a
  9-head, 3-KV-head model over 2 ranks is 6+3 query heads on 2+1 KV heads) and the query heads
  that read them; q/k/v rows (and biases) of those heads, ``o_proj`` columns of its query heads;
- the MLP by columns of the intermediate size: ``gate_proj``/``up_proj`` rows, ``down_proj``
  columns (as evenly as possible);
- the embedding, the LM head and the norms whole on every rank.

So each rank's shard is itself a smaller Llama (``shard_config``: its heads and intermediate
size), which the engine builds and runs as it runs any model, its KV cache holding only its KV
heads. Two partial sums need adding across ranks per layer, the outputs of ``o_proj`` and of
``down_proj``: ``LlamaForCausalLM.reduce`` is called on them (an in-place all-reduce: between CPU
ranks of one machine through shared memory, ``ShmAllReduce``; else over the ranks' process group,
gloo or NCCL between CUDA devices). After it every rank
holds the same residual stream, so each computes the same logits and samples the same tokens: the
ranks run the same engine loop in lockstep (the same requests, the same scheduling), and rank 0's
outputs are the model's.

Lockstep: rank 0's engine is the one its caller drives (``Leader``: requests and aborts as for any
engine); what changes the engine's state is applied there at once and sent to the other ranks at
the next step, in one broadcast before that step runs on every rank. The other ranks (``follow``)
only apply what the broadcast says and step. So every rank admits and schedules the same requests
at the same step whatever order their own inputs would have come in; their KV caches must be the
same size (the scheduler's decisions depend on it).
"""

from __future__ import annotations

import contextlib
import dataclasses
import mmap
import os
import select
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from prism_serve.engine.models.config import ArchConfig
from prism_serve.engine.weights import LoadedWeights
from prism_serve.errors import UnsupportedModelError

__all__ = [
    "Leader",
    "Shard",
    "ShmAllReduce",
    "agree_min",
    "all_reduce_over",
    "follow",
    "join_group",
    "leave_group",
    "shard_config",
    "shard_plan",
    "shard_weights",
]

# How long a rank waits in one collective (and for the others to join) before it gives up. Rank 0
# sends a heartbeat while idle (``Leader.heartbeat``) so the other ranks' wait for its next step
# never runs this long unless it is gone.
GROUP_TIMEOUT_S = 60.0


@dataclasses.dataclass(frozen=True, slots=True)
class Shard:
    """One rank's part of the decoder: KV heads ``[kv_start, kv_start + kv_heads)`` (and their
    query heads), intermediate columns ``[mlp_start, mlp_start + mlp_size)``."""

    rank: int
    world: int
    kv_start: int
    kv_heads: int
    heads_per_kv: int
    mlp_start: int
    mlp_size: int

    @property
    def q_start(self) -> int:
        return self.kv_start * self.heads_per_kv

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.heads_per_kv


def _even(n: int, world: int, rank: int) -> tuple[int, int]:
    """Start and size of ``rank``'s part of ``n`` items split as evenly as possible."""
    base, extra = divmod(n, world)
    return rank * base + min(rank, extra), base + (1 if rank < extra else 0)


def shard_plan(config: ArchConfig, world: int) -> list[Shard]:
    """Every rank's shard; UnsupportedModelError where ``world`` ranks cannot each take a KV head."""
    if world < 1:
        raise UnsupportedModelError(f"tensor parallel degree {world}: must be at least 1")
    if world > 1 and config.num_experts:
        raise UnsupportedModelError(
            "tensor parallelism of a mixture-of-experts model is not supported by the built-in engine "
            "(serve it on one device, or with engine: vllm)"
        )
    if world > config.num_kv_heads:
        raise UnsupportedModelError(
            f"tensor parallel degree {world} is above the model's {config.num_kv_heads} KV heads: "
            "every rank needs at least one"
        )
    group = config.num_heads // config.num_kv_heads
    out = []
    for rank in range(world):
        kv_start, kv_heads = _even(config.num_kv_heads, world, rank)
        mlp_start, mlp_size = _even(config.intermediate_size, world, rank)
        out.append(Shard(rank, world, kv_start, kv_heads, group, mlp_start, mlp_size))
    return out


def shard_config(config: ArchConfig, shard: Shard) -> ArchConfig:
    """The shape of one rank's part: a Llama with its heads and its intermediate size."""
    return dataclasses.replace(
        config, num_heads=shard.q_heads, num_kv_heads=shard.kv_heads, intermediate_size=shard.mlp_size
    )


def shard_weights(weights: LoadedWeights, shard: Shard) -> LoadedWeights:
    """Rank ``shard.rank``'s tensors (HF names, views where a slice is contiguous: rows)."""
    c = weights.config
    d = c.head_dim
    q = slice(shard.q_start * d, (shard.q_start + shard.q_heads) * d)
    kv = slice(shard.kv_start * d, (shard.kv_start + shard.kv_heads) * d)
    mlp = slice(shard.mlp_start, shard.mlp_start + shard.mlp_size)
    rows = {"q_proj": q, "k_proj": kv, "v_proj": kv, "gate_proj": mlp, "up_proj": mlp}
    cols = {"o_proj": q, "down_proj": mlp}
    out: dict[str, torch.Tensor] = {}
    for name, t in weights.tensors.items():
        module, _, kind = name.rpartition(".")
        module = module.rpartition(".")[2]
        if module in rows:
            out[name] = t[rows[module]].contiguous()  # weight rows, or the bias
        elif module in cols and kind == "weight":
            out[name] = t[:, cols[module]].contiguous()
        else:  # embedding, LM head, norms: whole on every rank
            out[name] = t
    return dataclasses.replace(weights, config=shard_config(c, shard), tensors=out)


def join_group(init_method: str, rank: int, world: int, device: str, timeout_s: float = GROUP_TIMEOUT_S):
    """Join the ranks' process group (this process's default group: a process serves one model at
    a time): gloo between CPU devices, NCCL between CUDA devices; returns it."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(
        backend,
        init_method=init_method,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    return dist.group.WORLD


def leave_group() -> None:
    """Dissolve this process's part of the group (also after another rank died)."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def agree_min(value: int, group=None) -> int:
    """The smallest of every rank's ``value`` (each rank calls this at the same point)."""
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def all_reduce_over(group) -> Callable[[torch.Tensor], None]:
    """An in-place sum of a tensor over ``group`` (a torch.distributed process group)."""
    import torch.distributed as dist

    def reduce(t: torch.Tensor) -> None:
        dist.all_reduce(t, group=group)

    return reduce


class ShmAllReduce:
    """In-place sums over the ranks of one machine through a shared memory file: each rank copies
    its partial sum into its slot, raises its counter, waits for every other rank's counter and
    adds the slots up in rank order (so every rank computes the same bits). Two sets of slots used
    in turn: a rank writes one set while a slower one may still read the other, and can never be
    two sums ahead (each waits for all). About 20 us a sum here, against 1.3 ms through gloo's TCP
    loopback. A tensor larger than a slot goes through ``group`` (gloo), as every rank decides the
    same. The counters are plain stores and loads: x86's memory order keeps a slot's bytes
    visible before its counter. A rank that waits checks the others are alive (pidfds) and raises
    RuntimeError when one is gone, as a collective would.

    Setting up takes no collective of its own: rank 0 makes the file (``create``) before any rank
    opens it (before the group forms, say), each rank opens it (``ShmAllReduce(...)``, which
    writes its pid there), and after any barrier over the ranks each calls ``connect`` (it reads
    the others' pids; rank 0 unlinks the file)."""

    _LINE = 64  # each rank's counter (and pid) on its own cache line

    @classmethod
    def _layout(cls, world: int, slot_bytes: int) -> tuple[int, int, int]:
        """The slot size (cache lines), the header's and the file's."""
        slot_bytes = -(-slot_bytes // cls._LINE) * cls._LINE
        header = world * cls._LINE
        return slot_bytes, header, header + 2 * world * slot_bytes

    @classmethod
    def create(cls, path: str, world: int, slot_bytes: int) -> None:
        """Rank 0: make the file, before any rank opens it."""
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, cls._layout(world, slot_bytes)[2])
        finally:
            os.close(fd)

    def __init__(self, path: str, rank: int, world: int, slot_bytes: int, group=None) -> None:
        self.path, self.rank, self.world, self.group = path, rank, world, group
        self.slot_bytes, header, size = self._layout(world, slot_bytes)
        slot_bytes = self.slot_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._peers: list[int] = []
        self._header = np.frombuffer(self._mm, dtype=np.int64, count=header // 8)
        self._header[rank * self._LINE // 8 + 1] = os.getpid()
        self._seq = self._header[:: self._LINE // 8]
        flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        at = [[header + (b * world + r) * slot_bytes for r in range(world)] for b in range(2)]
        self._slots = [[flat[a : a + slot_bytes] for a in row] for row in at]
        self._n = 0

    def connect(self) -> None:
        """After a barrier over the ranks (every one has opened the file): watch the others'
        processes; rank 0 unlinks the file (the mappings stay)."""
        pids = self._header[1 :: self._LINE // 8]
        self._peers = [os.pidfd_open(int(p)) for r, p in enumerate(pids) if r != self.rank]
        if self.rank == 0:
            os.unlink(self.path)

    def __call__(self, t: torch.Tensor) -> None:
        nbytes = t.numel() * t.element_size()
        if nbytes > self.slot_bytes or not t.is_contiguous():
            import torch.distributed as dist

            dist.all_reduce(t, group=self.group)
            return
        self._n += 1
        n, slots = self._n, self._slots[self._n % 2]
        slots[self.rank][:nbytes].copy_(t.view(-1).view(torch.uint8))
        self._seq[self.rank] = n
        self._wait(n)
        t.copy_(slots[0][:nbytes].view(t.dtype).view(t.shape))
        for r in range(1, self.world):
            t.add_(slots[r][:nbytes].view(t.dtype).view(t.shape))

    def _wait(self, n: int) -> None:
        seq, spins = self._seq, 0
        while seq.min() < n:
            spins += 1
            if spins > 200:  # not a matter of microseconds: let a rank that shares this core run
                os.sched_yield()
                if spins % 1000 == 0 and select.select(self._peers, [], [], 0)[0]:
                    raise RuntimeError("a rank of the tensor parallel group exited during an all-reduce")

    def close(self) -> None:
        for fd in self._peers:
            os.close(fd)
        self._peers = []
        self._slots = []
        self._seq = self._header = None
        with contextlib.suppress(BufferError):  # a view still refers to it: it goes with the last one
            self._mm.close()


class Leader:
    """Rank 0's engine as its caller drives it (the engine's own methods otherwise): requests and
    aborts go into the engine now and to the other ranks with the next step (``follow``)."""

    def __init__(self, engine: Any, group=None) -> None:
        self.engine = engine
        self.group = group
        self._pending: list[tuple] = []
        self.lost = False  # another rank is gone: close() must not wait for it

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def add_request(self, prompt_token_ids: list[int], params, req_id: str | None = None,
                    adapter: str | None = None) -> str:  # fmt: skip
        req_id = self.engine.add_request(prompt_token_ids, params, req_id, adapter)
        self._pending.append(("add", list(prompt_token_ids), params, req_id))
        return req_id

    def abort_request(self, req_id: str) -> bool:
        done = self.engine.abort_request(req_id)
        if done:
            self._pending.append(("abort", req_id))
        return done

    def abort_all(self) -> list[str]:
        ids = self.engine.abort_all()
        self._pending += [("abort", r) for r in ids]
        return ids

    def step(self) -> list:
        self._broadcast(self._pending)
        self._pending = []
        return self.engine.step()

    def heartbeat(self) -> None:
        """Idle: tell the other ranks that rank 0 is alive (their wait for its next step would
        otherwise time out), with any commands pending; they do not step."""
        self._broadcast([*self._pending, ("idle",)])
        self._pending = []

    def close(self) -> None:
        """End the followers' loops (``follow`` returns), then close this engine."""
        try:
            if not self.lost:
                self._broadcast([("stop",)])
        finally:
            self.engine.close()

    def _broadcast(self, commands: list[tuple]) -> None:
        import torch.distributed as dist

        dist.broadcast_object_list([commands], src=0, group=self.group)


def follow(engine: Any, group=None) -> int:
    """A rank other than 0: apply each step's commands from rank 0, then step (not after a
    heartbeat); returns the steps run when rank 0 closes (the caller closes the engine). A rank
    that died makes the collectives raise (RuntimeError) here and on every other rank."""
    import torch.distributed as dist

    steps = 0
    while True:
        box: list = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        idle = False
        for command in box[0]:
            if command[0] == "add":
                engine.add_request(command[1], command[2], command[3])
            elif command[0] == "abort":
                engine.abort_request(command[1])
            elif command[0] == "idle":
                idle = True
            else:  # "stop"
                return steps
        if not idle:
            engine.step()
            steps += 1
