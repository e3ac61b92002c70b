"""The control plane's prefix keys of a live prompt (runtime/requests.py ``prefix_keys``): the
request log's chaining at the control plane's block size, salted by the model or adapter name."""

from __future__ import annotations

from prism_serve.api.request_log import prompt_block_hashes
from prism_serve.control import PREFIX_BLOCK_TOKENS
from prism_serve.runtime.requests import prefix_keys


def test_prefix_keys_name_each_full_block_prefix_per_model_or_adapter():
    bt = PREFIX_BLOCK_TOKENS
    system = list(range(3 * bt))
    a = prefix_keys(system + [7] * (bt + 5), "chat")
    b = prefix_keys(system + [9] * (bt + 5), "chat")
    assert len(a) == len(b) == 4  # full blocks only
    assert a[:3] == b[:3] and a[3] != b[3]  # equal up to the first block where the prompts differ
    assert prefix_keys(system, "chat") == a[:3]  # the same in every call (no hash(), no state)
    # chained: an equal block after a differing one is a different key
    assert prefix_keys([1] * bt + system[bt:], "chat")[1:] != a[1:3]
    # salted by the name: two adapters of one base never match, nor match the base
    assert not set(prefix_keys(system, "chat-lora")) & set(a)
    assert all(0 <= k < 1 << 63 for k in a)
    # the request log's keys are the same chaining without a salt
    assert prompt_block_hashes(system, bt) != list(a[:3]) and len(prompt_block_hashes(system, bt)) == 3
    assert prefix_keys(list(range(bt - 1)), "chat") == ()
