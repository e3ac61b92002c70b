"""What the controller takes a model's KV to be in its engine. A tensor parallel model's KV blocks,
fixed at activation: the bytes its rule gives (kv_limit, or room for four requests of
max_model_len), in blocks of the size its engine lays out, which for a model whose windowed layers
keep their own blocks (engine/kv_cache.py KVGroups) are smaller. And the KV a request takes there,
which admission checks before it dispatches: for such a model, its full-context layers' for every
token and its windowed layers' for a window's worth at most."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

from prism_serve.engine.config import EngineConfig
from prism_serve.engine.models.config import PRESETS
from prism_serve.runtime.models import ModelSpec
from prism_serve.runtime.state import TP_KV_REQUESTS, ModelEntry
from prism_serve.runtime.weight_cache import config_from_dict


def _entry(preset: str, windowed_kv: bool = True) -> ModelEntry:
    config = PRESETS[preset]
    cached = SimpleNamespace(
        config=dataclasses.asdict(config), ranks=(), kv_bytes_per_token=config.kv_bytes_per_token(2)
    )
    spec = ModelSpec("m", engine=EngineConfig(max_model_len=4096, block_size=16, windowed_kv=windowed_kv))
    return ModelEntry(spec, cached=cached, tokenizer=None, max_model_len=4096)


def test_the_same_bytes_in_blocks_of_the_engines_size():
    llama = _entry("llama-3.2-1b")
    assert llama.tp_kv_blocks() == TP_KV_REQUESTS * 4096 // 16
    # Gemma 3 1B: a block holds 4 of its 26 layers (KV groups of its global layers' count), so
    # the same bytes make 26 / 4 as many blocks
    gemma = _entry("gemma-3-1b")
    assert gemma.tp_kv_blocks() == TP_KV_REQUESTS * 4096 // 16 * 26 // 4
    assert _entry("gemma-3-1b", windowed_kv=False).tp_kv_blocks() == TP_KV_REQUESTS * 4096 // 16
    assert config_from_dict(gemma.cached.config) == PRESETS["gemma-3-1b"]


def test_a_request_holds_the_full_context_layers_and_one_window_of_the_others():
    gemma = _entry("gemma-3-1b")
    per_layer = PRESETS["gemma-3-1b"].kv_bytes_per_token(2) // 26
    # 4 global layers; 6 windowed groups of 4 slots (2 of them padding) hold 512 - 1 + 512 + 32
    assert gemma.engine_kv_split == (4 * per_layer, (1055, 24 * per_layer))
    for flat in (_entry("gemma-3-1b", windowed_kv=False), _entry("llama-3.2-1b")):
        assert flat.engine_kv_split == (flat.cached.kv_bytes_per_token, None)
