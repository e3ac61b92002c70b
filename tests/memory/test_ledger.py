from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from prism_serve.errors import InvalidRequestError
from prism_serve.memory.ledger import DeviceLedger, LedgerError, LedgerNotFoundError, ledger_path
from prism_serve.memory.spare import grant_waiting

MiB = 2**20


def test_grants_stop_at_the_device_budget(make_ledger):
    ledger = make_ledger(budget_bytes=10 * MiB)
    a, b = ledger.account("a"), ledger.account("b")
    assert a.try_reserve(6 * MiB)
    assert not b.try_reserve(5 * MiB)  # 11 > 10: refused, nothing recorded
    assert b.try_reserve(4 * MiB)
    assert not a.try_reserve(1)
    snap = ledger.snapshot()
    assert snap.used_bytes == 10 * MiB and snap.free_bytes == 0
    assert {e.name: e.mapped_bytes for e in snap.entries} == {"a": 6 * MiB, "b": 4 * MiB}
    a.release(6 * MiB)
    assert b.try_reserve(6 * MiB)
    assert b.entry().peak_bytes == 10 * MiB


def test_a_second_process_sees_the_same_budget(make_ledger, namespace):
    ledger = make_ledger(budget_bytes=10 * MiB)
    ledger.account("here").try_reserve(7 * MiB)
    code = (
        "from prism_serve.memory.ledger import DeviceLedger\n"
        f"l = DeviceLedger('cpu:0', namespace='{namespace}')\n"
        "a = l.account('there')\n"
        "print(a.try_reserve(4 * 2**20), a.try_reserve(3 * 2**20), l.snapshot().used_bytes)\n"
        "a.close()\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True", str(10 * MiB)]
    assert ledger.snapshot().used_bytes == 7 * MiB  # the child's close gave its 3 MiB back


def test_per_engine_limit_and_run_time_changes(make_ledger):
    ledger = make_ledger(budget_bytes=100 * MiB)
    a = ledger.account("a", limit_bytes=5 * MiB)
    assert a.try_reserve(5 * MiB) and not a.try_reserve(1)
    a.set_limit(None)
    assert a.try_reserve(10 * MiB)
    a.set_limit(2 * MiB)  # below what it holds: no new grants, nothing taken away
    assert a.entry().mapped_bytes == 15 * MiB and not a.try_reserve(1)
    ledger.set_budget(1 * MiB)
    a.set_limit(None)
    assert not a.try_reserve(1)  # the device is over its new budget until memory is freed
    a.release(15 * MiB)
    assert a.try_reserve(MiB) and not a.try_reserve(1)


def test_bad_calls_raise_named_errors(make_ledger, namespace):
    with pytest.raises(LedgerNotFoundError):
        DeviceLedger("cpu:7", namespace=namespace)
    ledger = make_ledger(budget_bytes=MiB)
    a = ledger.account("a")
    with pytest.raises(LedgerError, match="holds 0"):
        a.release(1)
    with pytest.raises(InvalidRequestError):
        a.try_reserve(-1)
    with pytest.raises(InvalidRequestError):
        ledger.set_budget(-1)
    with pytest.raises(LedgerError, match="not registered"):
        ledger.try_reserve(200, 1)
    with pytest.raises(InvalidRequestError):
        DeviceLedger("cpu:0/../x", budget_bytes=1, namespace=namespace)
    a.close()
    with pytest.raises(LedgerError, match="not registered"):
        a.try_reserve(1)


def _child_holding(namespace: str, num_bytes: int) -> subprocess.Popen:
    code = (
        "import sys, time\n"
        "from prism_serve.memory.ledger import DeviceLedger\n"
        f"a = DeviceLedger('cpu:0', namespace='{namespace}').account('doomed')\n"
        f"assert a.try_reserve({num_bytes})\n"
        "print('ready', flush=True)\n"
        "time.sleep(600)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


@pytest.mark.parametrize("reap", [False, True], ids=["zombie", "reaped"])
def test_budget_of_a_sigkilled_process_is_reclaimed_by_the_next_operation(make_ledger, namespace, reap):
    ledger = make_ledger(budget_bytes=10 * MiB)
    survivor = ledger.account("survivor")
    child = _child_holding(namespace, 8 * MiB)
    assert not survivor.try_reserve(3 * MiB)
    os.kill(child.pid, signal.SIGKILL)
    if reap:
        child.wait()
    else:  # wait for the exit without reaping: the pid still exists as a zombie, which must count as dead
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)
        assert Path(f"/proc/{child.pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    assert survivor.try_reserve(10 * MiB)  # the very next operation reclaimed the 8 MiB
    assert [e.name for e in ledger.snapshot().entries] == ["survivor"]
    child.wait()


def test_peek_reads_without_waiting_for_the_lock_and_leaves_out_dead_engines(make_ledger, namespace):
    ledger = make_ledger(budget_bytes=10 * MiB)
    mine = ledger.account("mine")
    assert mine.try_reserve(1 * MiB)
    child = _child_holding(namespace, 4 * MiB)
    assert ledger.peek() == ledger.snapshot()
    assert ledger.peek().used_bytes == 5 * MiB
    # another holder of the file lock (a second open file: flock excludes it) does not block a peek
    holder = DeviceLedger("cpu:0", namespace=namespace)
    done = threading.Event()
    with holder:
        reader = threading.Thread(target=lambda: (ledger.peek(), done.set()))
        reader.start()
        assert done.wait(10), "peek waited for the file lock"
        # a snapshot does wait for it
        snap = threading.Thread(target=ledger.snapshot)
        snap.start()
        snap.join(0.5)
        assert snap.is_alive()
    snap.join(10)
    reader.join()
    holder.close()
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    # the dead engine is out of a peek at once, but only a locked operation reclaims its entry
    assert [e.name for e in ledger.peek().entries] == ["mine"] and ledger.peek().used_bytes == 1 * MiB
    assert ledger._entries["pid"].astype(bool).sum() == 2
    assert [e.name for e in ledger.snapshot().entries] == ["mine"]
    assert ledger._entries["pid"].astype(bool).sum() == 1


def test_a_reused_pid_is_not_mistaken_for_the_dead_engine(make_ledger):
    ledger = make_ledger(budget_bytes=10 * MiB)
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        slot = ledger.register("old-engine", pid=sleeper.pid)
        assert ledger.try_reserve(slot, 5 * MiB)
        with ledger:  # the entry now claims a start time the live process with this pid does not have
            ledger._entries[slot]["start_ticks"] -= 1
        assert ledger.snapshot().used_bytes == 0
    finally:
        sleeper.kill()
        sleeper.wait()


def test_list_devices_and_unlink(make_ledger, namespace):
    make_ledger("cpu:0", MiB)
    make_ledger("cpu:1", MiB)
    make_ledger("cuda:3", MiB)
    assert DeviceLedger.list_devices(namespace) == ["cpu:0", "cpu:1", "cuda:3"]
    make_ledger("cpu:1").unlink()
    assert DeviceLedger.list_devices(namespace) == ["cpu:0", "cuda:3"]


def run_prism(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "prism_serve.cli", *args], capture_output=True, text=True, timeout=120
    )


def test_prism_memory_shows_and_limits_engines(make_ledger):
    ledger = make_ledger("cpu:1", budget_bytes=8 * 2**30)
    eng = ledger.account("smollm2-135m", limit_bytes=2**30)
    assert eng.try_reserve(40 * MiB)
    res = run_prism("memory")
    assert res.returncode == 0, res.stderr
    assert "cpu:1  budget 8.0 GiB  used 40.0 MiB (0.5%)" in res.stdout
    assert "cached KV" not in res.stdout
    eng.set_reclaimable(8 * MiB)  # its prefix cache's unheld blocks
    assert "cached KV 8.0 MiB (reclaimable)" in run_prism("memory").stdout
    row = next(line for line in res.stdout.splitlines() if "smollm2-135m" in line)
    assert str(os.getpid()) in row and "40.0 MiB" in row and "1.0 GiB" in row
    res = run_prism(
        "memory", "--device", "cpu:1", "--set-limit", "smollm2-135m=512MiB", "--set-budget", "4GiB"
    )
    assert res.returncode == 0, res.stderr
    assert eng.entry().limit_bytes == 512 * MiB and ledger.budget_bytes == 4 * 2**30
    res = run_prism("memory", "--device", "cpu:1", "--set-limit", "nobody=1GiB")
    assert res.returncode == 2 and "no live engine called 'nobody'" in res.stderr
    res = run_prism("memory", "--set-budget", "1GiB")
    assert res.returncode == 2 and "need --device" in res.stderr


def test_prism_memory_without_ledgers_says_so(namespace):
    res = run_prism("memory")
    assert res.returncode == 0 and "no memory ledgers" in res.stdout


def test_an_account_that_takes_memory_ahead_of_need_asks_no_one_for_spare_pages(make_ledger):
    ledger = make_ledger(budget_bytes=16 * MiB)
    holder = ledger.account("w0 spare", spare=True)
    assert holder.try_reserve(12 * MiB)
    ahead = ledger.account("w1 vllm prepare")
    ahead.reclaim = False  # a vLLM engine built in a worker's idle time (runtime/vllm_slot.py)
    assert not ahead.try_reserve(8 * MiB)
    snap = ledger.snapshot()
    assert snap.reclaim_bytes == 0 and snap.refused_at == 0, "its refusal asked the spare holder for nothing"
    assert ahead.try_reserve(4 * MiB)  # free memory it takes
    assert not grant_waiting(ahead, 8 * MiB, wait_s=60)  # refused at once: it waits for no one
    assert ledger.snapshot().reclaim_bytes == 0
    assert not ahead.try_reserve(8 * MiB, reclaim=True) and ledger.snapshot().reclaim_bytes == 8 * MiB


def test_cached_kv_counts_as_reclaimable_and_is_asked_back(make_ledger):
    """An engine's prefix-cached KV (``set_reclaimable``) is memory a refused grant may ask back,
    with spare pages: the request stands while it is owed and shrinks as the holder releases it;
    a placement counts it as free (``engine_bytes``), never more than the holder maps."""
    ledger = make_ledger(budget_bytes=16 * MiB)
    holder = ledger.account("a kv")
    assert holder.try_reserve(12 * MiB)
    holder.set_reclaimable(20 * MiB)  # capped at what it maps
    assert holder.entry().reclaimable_bytes == 12 * MiB
    holder.set_reclaimable(8 * MiB)
    snap = ledger.snapshot()
    assert snap.cached_bytes == snap.reclaimable_bytes == 8 * MiB and snap.engine_bytes == 4 * MiB
    other = ledger.account("b weights")
    assert not other.try_reserve(16 * MiB)  # more than even the cache would free: asks for nothing
    assert ledger.snapshot().reclaim_bytes == 0
    assert not grant_waiting(other, 16 * MiB, wait_s=60)  # refused at once, no wait
    assert not other.try_reserve(8 * MiB)
    assert ledger.reclaim_wanted() == 4 * MiB  # the shortfall, which the cache can cover
    holder.release(4 * MiB)  # the holder dropped cached blocks and unmapped their pages
    assert ledger.reclaim_wanted() == 0 and holder.entry().reclaimable_bytes == 4 * MiB
    assert other.try_reserve(8 * MiB)


def test_a_ledger_file_of_another_version_is_a_named_error(namespace):
    """An older prism-serve's ledger (another size, or another magic) is refused with what to do,
    never read as this version's entries."""
    path = ledger_path("cpu:0", namespace)
    path.write_bytes(b"PRISMLG2" + bytes(100))
    with pytest.raises(LedgerError, match=r"not a prism memory ledger of this version.*remove it"):
        DeviceLedger("cpu:0", 2**30, namespace=namespace)
    DeviceLedger("cpu:0", 2**30, namespace=namespace + "x").close()  # another namespace is unaffected
    ledger_path("cpu:0", namespace + "x").unlink()
