"""A real engine-like process for the multi-process memory tests: one elastic KV pool on cpu:0,
driven by JSON lines on stdin (one reply line per command on stdout).

Every allocated block is filled with a pattern derived from its id, and checked when freed, so a
page mapped or unmapped underneath a live block (in this process or through another's grant) shows
up as corrupted data.

Commands: {"op": "alloc", "n": N} -> {"ids": [...] | null}; {"op": "free", "ids": [...]};
{"op": "trim"}; {"op": "state"} -> pool and ledger numbers; {"op": "loop", ...} random churn;
{"op": "exit"}.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import os
import random
import sys

import numpy as np

from prism_serve.memory.kv_pool import ElasticKVPool, PoolConfig
from prism_serve.memory.ledger import DeviceLedger
from prism_serve.memory.vmm import HostVirtualRange


def main() -> None:
    faulthandler.enable()  # a crash (a page unmapped under a live block, say) prints where it was
    cfg = json.loads(sys.argv[1])
    ledger = DeviceLedger("cpu:0", namespace=cfg["namespace"])
    account = ledger.account(cfg["name"])
    vrange = HostVirtualRange("cpu:0", cfg["reserve_bytes"], cfg["page_size"])
    pool = ElasticKVPool(
        vrange,
        cfg["block_bytes"],
        account,
        PoolConfig(
            page_size=cfg["page_size"],
            prefetch=cfg.get("prefetch", False),
            buffer_min_pages=cfg.get("buffer_min_pages", 0),
            buffer_max_pages=cfg.get("buffer_max_pages", 0),
            poll_interval_s=0.01,
        ),
    )
    # numpy over the reserved range (not torch: keeps the worker's start-up fast).
    size = pool.num_total_blocks * cfg["block_bytes"]
    flat = np.frombuffer((ctypes.c_ubyte * size).from_address(vrange.address), dtype=np.uint8)
    view = flat.reshape(-1, cfg["block_bytes"])
    held: set[int] = set()
    bad: list[int] = []

    def fill(ids: list[int]) -> None:
        for b in ids:
            view[b].fill((b * 7 + 3) % 251)

    def check_and_free(ids: list[int]) -> None:
        for b in ids:
            row = view[b]
            want = (b * 7 + 3) % 251
            if int(row[0]) != want or int(row[-1]) != want or not bool((row == want).all()):
                bad.append(b)
        pool.free(ids)
        held.difference_update(ids)

    def reply(obj: dict) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    reply({"pid": os.getpid(), "fd": vrange._fd, "slot": account.slot})
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        if op == "alloc":
            ids = pool.allocate(cmd["n"])
            if ids is not None:
                fill(ids)
                held.update(ids)
            reply({"ids": ids})
        elif op == "free":
            check_and_free(cmd["ids"])
            reply({})
        elif op == "trim":
            reply({"unmapped": pool.trim(0)})
        elif op == "loop":  # free-running churn for the concurrency test
            rng = random.Random(cmd["seed"])
            refused = 0
            for _ in range(cmd["steps"]):
                if held and rng.random() < 0.5:
                    check_and_free(rng.sample(sorted(held), rng.randint(1, len(held))))
                else:
                    ids = pool.allocate(rng.randint(1, cmd["max_n"]))
                    if ids is None:
                        refused += 1
                    else:
                        fill(ids)
                        held.update(ids)
            check_and_free(sorted(held))
            reply({"refused": refused})
        elif op == "state":
            st = pool.stats()
            reply(
                {
                    "held": sorted(held),
                    "bad": bad,
                    "mapped_pages": st.mapped_pages,
                    "physical": vrange.physical_bytes(),
                    "ledger_mapped": account.entry().mapped_bytes,
                    "pages_of_held_mapped": all(vrange.is_mapped(q) for b in held for q in pool._pages_of(b)),
                }
            )
        elif op == "exit":
            pool.close()
            vrange.close()
            account.close()
            reply({})
            return


if __name__ == "__main__":
    main()
