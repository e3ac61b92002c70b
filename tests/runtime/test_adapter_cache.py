"""LoRA adapters in the host cache (runtime/weight_cache.py ``write_adapter``, runtime/adapters.py
``MappedAdapters``): the file a worker maps holds exactly the checked weights the controller read,
a worker's views of it are made only when read, and the file goes with the adapter and with the
cache, and with a controller that died."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from prism_serve.engine.lora import LoraSlots, read_adapter
from prism_serve.runtime.adapters import MappedAdapters
from prism_serve.runtime.weight_cache import HostWeightCache
from tests.peft_adapters import make_adapter


def test_the_mapped_file_holds_the_checked_weights_and_goes_with_the_adapter(smollm, smollm_hf, tmp_path):
    path = make_adapter(smollm_hf, tmp_path / "mixed", 8, 16, ["q_proj", "down_proj"], seed=4)
    config = smollm.config
    read = read_adapter(path, config, 16, "mixed")
    with HostWeightCache(f"adaptertest-{os.getpid()}", tmp_path) as cache:
        f = cache.write_adapter(read)
        assert os.path.getsize(f.cache_path) == f.size >= read.nbytes
        assert cache.total_bytes == f.size
        mapped = MappedAdapters()
        view = mapped.get(f, config, 16)
        assert (view.name, view.rank, view.target_modules) == ("mixed", 8, ("q_proj", "down_proj"))
        assert len(view.weights) == len(read.weights) == 2 * config.num_layers
        for key, (a, b) in read.weights.items():
            va, vb = view.weights[key]
            assert torch.equal(va, a) and torch.equal(vb, b)
        assert mapped.get(f, config, 16) is view  # mapped once per worker
        # a slot loaded from the mapping equals one loaded from the files
        slots = LoraSlots(config, 2, 16, torch.float32)
        slots.load(0, read)
        slots.load(1, view)
        for key in slots.a:
            assert torch.equal(slots.a[key][0], slots.a[key][1])
            assert torch.equal(slots.b[key][0], slots.b[key][1])
        mapped.forget("mixed")
        cache.drop_adapter(f.cache_path)
        assert not os.path.exists(f.cache_path)
        kept = cache.write_adapter(read)
    assert not os.path.exists(kept.cache_path)  # the cache's close removes its adapters' files


def test_a_dead_controllers_adapter_files_are_removed(smollm, tmp_path):
    namespace = f"adapterstale-{os.getpid()}"
    script = (
        "import sys; from prism_serve.runtime.weight_cache import HostWeightCache\n"
        "from prism_serve.engine.lora import LoraAdapter\n"
        "import torch\n"
        f"c = HostWeightCache({namespace!r}, {str(tmp_path)!r})\n"
        "a = LoraAdapter('x', '/x', 1, ('q_proj',), {(0, 'q_proj'): (torch.ones(1, 4), torch.ones(4, 1))})\n"
        "print(c.write_adapter(a).cache_path)\n"
        "import os; os._exit(0)\n"  # no close: the file stays, as after a SIGKILL
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    path = out.stdout.strip()
    assert path.endswith(".lora") and os.path.exists(path)
    HostWeightCache(namespace, tmp_path).close()  # a new controller's cache clears the stale ones
    assert not os.path.exists(path)
