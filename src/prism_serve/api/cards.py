"""The model cards of ``GET /v1/models`` (and of the admin routes' answers): one per served model,
OpenAI's fields plus prism's state, placement, SLOs, memory and replicas."""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from prism_serve.runtime.serving import AdapterSpec, ModelStatus

__all__ = ["adapter_cards", "model_cards"]


def model_cards(statuses: Iterable[ModelStatus], roots: Mapping[str, str]) -> list[dict[str, Any]]:
    """A card per status; ``roots``: each model's public weights name (never a path on the server)."""
    created = int(time.time())
    cards = []
    for st in statuses:
        last = st.last_activation
        cards.append({
            "id": st.model, "object": "model", "created": created, "owned_by": "prism-serve",
            "root": roots.get(st.model, st.model), "parent": None,
            "state": st.state, "device": st.device, "pinned": st.pinned,
            # tensor parallel: the degree, and every rank's device while resident (rank 0 first)
            "tp": st.tp, "devices": list(st.devices) or ([st.device] if st.device else []),
            "source": roots.get(st.model, st.model), "synthetic": st.synthetic, "dtype": st.dtype,
            "max_model_len": st.max_model_len,
            "ttft_slo": st.ttft_slo, "tpot_slo": st.tpot_slo,
            # what a request that leaves a sampling setting out gets (the config's sampling, over
            # the model's generation_config.json); the rest are OpenAI's defaults
            "sampling_defaults": dict(st.sampling),
            "weight_bytes": st.weight_bytes, "used_kv_bytes": st.used_kv_bytes,
            # prefix-cached KV no request holds: given back first when the device needs memory
            "cached_kv_bytes": st.cached_kv_bytes,
            "num_running": st.num_running, "num_queued": st.num_queued,
            "num_activations": st.num_activations, "num_evictions": st.num_evictions,
            # the last activation's engine: compiled graph (vLLM, vllm_compile), and how its
            # weights came in (messages.ActivationPhases.load_path); null before any
            "engine_compiled": last.compiled if last else None,
            "weights_loaded_by": last.load_path if last else None,
            # the last activation: seconds in all, and the cached prefixes kept at the eviction
            # before it that it restored into the engine (blocks, seconds of the total)
            "last_activation": {
                "seconds": last.total_s, "restored_prefix_blocks": last.restored_blocks,
                "restore_s": last.restore_s,
            } if last else None,
            "replicas": [
                {"replica": r.replica, "state": r.state, "device": r.device,
                 "num_running": r.num_running, "num_queued": r.num_queued,
                 "num_served": r.num_served}
                for r in st.replicas
            ],
        })  # fmt: skip
    return cards


def adapter_cards(adapters: Iterable[AdapterSpec], bases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """A card per LoRA adapter, as vLLM lists them: ``parent`` its base, ``root`` its directory's
    name; its base's state and placement (it runs in its base's engine), its own SLOs."""
    by_id = {c["id"]: c for c in bases}
    cards = []
    for a in adapters:
        base = by_id.get(a.base)
        if base is None:
            continue
        cards.append({
            "id": a.name, "object": "model", "created": base["created"], "owned_by": "prism-serve",
            "root": Path(a.path).name, "parent": a.base,
            "state": base["state"], "device": base["device"], "max_model_len": base["max_model_len"],
            "ttft_slo": a.ttft_slo, "tpot_slo": a.tpot_slo, "sampling_defaults": base["sampling_defaults"],
            "adapter": {"rank": a.rank, "target_modules": list(a.target_modules), "bytes": a.nbytes},
        })  # fmt: skip
    return cards
