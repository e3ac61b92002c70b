"""vLLM's KV layout on a CUDA GPU: pages on demand (StridedKVPages) under a CudaVirtualRange, the
buffer handed out the way the vLLM engine hands it to vLLM (``FromRange.zeros``), and per-layer
views written and read by GPU kernels while the watermark moves. vLLM's CUDA wheels pin a torch the
GPU machine does not have, so this is the part of the vLLM engine's device path that runs there
without vLLM. The same checks run on host pages everywhere; the GPU case is skipped without a GPU
(conftest.py)."""

from __future__ import annotations

import pytest
import torch

from prism_serve.engine.vllm_kv import FromRange
from prism_serve.memory.strided_kv import StridedKVPages
from prism_serve.memory.vmm import reserve

DEVICES = [pytest.param("cpu:0"), pytest.param("cuda:0", marks=pytest.mark.gpu)]

MiB = 2**20
LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM = 30, 16, 3, 64  # SmolLM2-135M's KV, bf16
BLOCK_BYTES = 2 * BLOCK_SIZE * KV_HEADS * HEAD_DIM * 2
BLOCKS = 1024


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def layer_views(flat: torch.Tensor) -> list[torch.Tensor]:
    """Per-layer views as vLLM's attention backends take them: (blocks, 2, block_size, heads, dim)."""
    stride = BLOCKS * BLOCK_BYTES
    return [
        flat[i * stride : (i + 1) * stride]
        .view(torch.bfloat16)
        .view(BLOCKS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
        for i in range(LAYERS)
    ]


def pattern(layer: int, blocks: int, device: str) -> torch.Tensor:
    ids = torch.arange(blocks, device=device, dtype=torch.float32)
    return ((ids % 97) + layer * 0.5).to(torch.bfloat16).view(blocks, 1, 1, 1, 1)


@pytest.mark.parametrize("device", DEVICES)
def test_vllm_layout_pages_follow_the_watermark_and_keep_the_data_below_it(make_ledger, device):
    size = LAYERS * BLOCKS * BLOCK_BYTES
    ledger = make_ledger(device, budget_bytes=2 * size)
    with reserve(device, -(-size // (2 * MiB)) * 2 * MiB) as vrange:
        kv = StridedKVPages(vrange, LAYERS, BLOCKS * BLOCK_BYTES, BLOCK_BYTES, BLOCKS)
        account = ledger.account("m kv")
        kv.attach(account)
        assert kv.resize(1)  # the null block, mapped before vLLM sees the buffer
        flat = FromRange(vrange.as_tensor()).zeros(size, dtype=torch.uint8)
        assert flat.device.type == device.split(":")[0] and flat.data_ptr() == vrange.address
        views = layer_views(flat)

        assert kv.resize(600)
        for layer, v in enumerate(views):
            v[:600].copy_(pattern(layer, 600, device).expand(600, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM))
        sync(device)
        assert vrange.physical_bytes() == kv.mapped_bytes == account.entry().mapped_bytes

        assert kv.resize(200)  # pages above block 200 go back; the blocks below keep their data
        assert kv.mapped == kv.pages_for(200)
        assert (
            vrange.physical_bytes()
            == kv.mapped_bytes
            == account.entry().mapped_bytes
            < 600 * BLOCK_BYTES * LAYERS
        )
        for layer, v in enumerate(views):
            assert torch.equal(v[:200, :, 0, 0, 0], pattern(layer, 200, device).view(200, 1).expand(200, 2))

        assert kv.resize(BLOCKS)  # grows again over freshly mapped pages, writable in every layer
        for layer, v in enumerate(views):
            v[200:].fill_(layer + 1)
        sync(device)
        for layer, v in enumerate(views):
            assert torch.equal(v[:200, :, 0, 0, 0], pattern(layer, 200, device).view(200, 1).expand(200, 2))
            assert bool((v[200:] == layer + 1).all())

        kv.close()
        assert vrange.physical_bytes() == 0 and account.entry().mapped_bytes == 0
        assert ledger.snapshot().used_bytes == 0


@pytest.mark.parametrize("device", DEVICES)
def test_growth_stops_where_the_ledger_does_and_maps_nothing_more(make_ledger, device):
    size = LAYERS * BLOCKS * BLOCK_BYTES
    ledger = make_ledger(device, budget_bytes=size)
    with reserve(device, -(-size // (2 * MiB)) * 2 * MiB) as vrange:
        neighbour = ledger.account("neighbour")
        assert neighbour.try_reserve(size - 40 * 2 * MiB)  # room for 40 pages: 1 row of 30, not 2
        kv = StridedKVPages(vrange, LAYERS, BLOCKS * BLOCK_BYTES, BLOCK_BYTES, BLOCKS)
        kv.attach(ledger.account("m kv"))
        reached = kv.grow_by_pages(BLOCKS)
        assert 1 <= reached < BLOCKS
        assert len(kv.pages_for(reached)) <= 40 < len(kv.pages_for(reached + 1))
        assert vrange.physical_bytes() == kv.mapped_bytes <= 40 * 2 * MiB
        neighbour.release(size - 40 * 2 * MiB)  # the neighbour's memory comes back: growth goes on
        assert kv.resize(BLOCKS)
        assert ledger.snapshot().used_bytes <= ledger.budget_bytes
        kv.close()
        assert vrange.physical_bytes() == 0
