"""DeviceRoom: the "dispatch only what an engine can start now" rule."""

from __future__ import annotations

from prism_serve.control.capacity import DeviceRoom, Fit
from tests.control.factories import GIB, device, engine

KIB = 1024


def test_room_is_private_kv_plus_shared_free_memory_minus_the_reserve():
    dev = device(cap_gib=1, mapped_gib=1 - 100 * KIB / GIB)  # 100 KiB shared
    room = DeviceRoom(dev, {"a": engine("a", free_gib=50 * KIB / GIB, kvpt=KIB)}, reserve_tokens=10)
    # (prompt + 1) KiB needed, 150 KiB of room, 10 KiB reserve: a 139-token prompt fits, 140 does not
    assert room.fit("a", 139) is Fit.OK
    assert room.fit("a", 140) is Fit.NO_MEMORY
    room.take("a", 39)  # 40 KiB: all of it from the engine's own free KV
    assert room.shared == 100 * KIB
    room.take("a", 29)  # 30 KiB: 10 from its own, 20 from the shared pool
    assert room.shared == 80 * KIB
    assert room.fit("a", 69) is Fit.OK and room.fit("a", 70) is Fit.NO_MEMORY


def test_quota_caps_the_room_and_is_not_a_shared_memory_wait():
    dev = device(cap_gib=80)
    room = DeviceRoom(dev, {"a": engine("a", quota_gib=64 * KIB / GIB, used_gib=32 * KIB / GIB, kvpt=KIB)}, 0)
    assert room.fit("a", 31) is Fit.OK and room.fit("a", 32) is Fit.NO_MEMORY
    assert not room.short_of_shared("a", 32), "waiting for its own quota must not hold the shared pool"


def test_readiness_slots_and_prompts_that_never_fit():
    dev = device()
    engines = {
        "loading": engine("loading", ready=False, free_gib=1),
        "full": engine("full", free_gib=1, max_seqs=4, running=4),
        "small": engine("small", free_gib=1, kvpt=KIB, max_kv=100 * KIB),
    }
    room = DeviceRoom(dev, engines, 0)
    assert room.fit("loading", 1) is Fit.NOT_READY and room.fit("absent", 1) is Fit.NOT_READY
    assert room.fit("full", 1) is Fit.NO_SLOT
    assert room.fit("small", 100) is Fit.NEVER and room.fit("small", 99) is Fit.OK
    assert room.startable() == {"small"}


def test_engines_on_other_devices_are_ignored():
    room = DeviceRoom(device("d0"), {"a": engine("a", "d1", free_gib=1)}, 0)
    assert room.fit("a", 1) is Fit.NOT_READY


def test_an_engine_whose_windowed_layers_free_their_past_needs_their_window_only():
    """A Gemma-like engine (engine/kv_cache.py KVGroups): its full-context layers hold every token
    (1 KiB each here), its windowed layers at most their last 100 tokens (3 KiB each). A 999-token
    prompt needs 1000 + 300 KiB, not 4000: it fits an engine that could never hold 4000 KiB; and
    the reserve for the running requests' next tokens counts every layer."""
    import dataclasses

    dev = device(cap_gib=1, mapped_gib=1 - 2000 * KIB / GIB)  # 2000 KiB shared
    windowed = dataclasses.replace(
        engine("g", free_gib=0, kvpt=KIB, max_kv=1500 * KIB), kv_window=(100, 3 * KIB)
    )
    assert windowed.kv_bytes(50) == 50 * 4 * KIB and windowed.kv_bytes(1000) == 1300 * KIB
    assert DeviceRoom(dev, {"g": windowed}, 0).fit("g", 999) is Fit.OK
    every_layer = engine("g", kvpt=4 * KIB, max_kv=1500 * KIB)  # the same model without the split
    assert DeviceRoom(dev, {"g": every_layer}, 0).fit("g", 999) is Fit.NEVER
    # 10 tokens of reserve at 4 KiB: 2000 - 40 KiB of room, a 1659-token prompt needs 1660 + 300
    room = DeviceRoom(dev, {"g": dataclasses.replace(windowed, max_kv_bytes=None)}, reserve_tokens=10)
    assert room.fit("g", 1659) is Fit.OK and room.fit("g", 1660) is Fit.NO_MEMORY
