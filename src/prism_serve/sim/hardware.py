"""Hardware profiles the cost model reads: one frozen record per device kind, in a registry.

The GPU rows are **synthetic**: vendor datasheet peaks (dense bf16 FLOP/s, HBM bandwidth, host link
and NVLink bandwidth per direction) times efficiency factors we chose, not measurements of ours.
The efficiency factors are typical of a well-tuned serving engine (decode reaching ~90% of HBM
bandwidth, prefill ~60% of peak FLOP/s) and put activation of an 8B model near the 0.7 s the Prism
paper reports for H100 (its Figure 9).

The ``cpu-smollm2`` row is **fitted on this machine** (2-vCPU AMD EPYC VM with AVX2, no AVX-512;
torch 2.13 CPU) to this project's own engine running SmolLM2-135M in fp32 on ONE core with ONE torch
thread, the way a live CPU device of one core runs (runtime/devices.py; ``prism serve``'s default
config splits this 2-core machine into two such devices). Step constants, refitted 2026-11-24 on
the host of that day, whose steps ran 11-15% slower than the 2026-11-23 fit (same CPU model and
flags; VMs of one type differ): ``python benchmarks/fit_cpu_profile.py --trace <light and heavy
live runs' step traces> --held-out <three other runs'> --points <a --rounds 2 measurement>`` (the
points carry 25% of the weight; decode, prefill and mixed steps one third of the live weight
each, since every TTFT hangs on the few prefill steps), i.e. jointly on 3,776 live worker steps
(each step's CPU seconds, PRISM_STEP_TRACE) and 26 measured points that reach the batches and
contexts a light live run never steps; held out: 5,932 steps of three qlm runs of the day before
(errors in docs/results.md, "The CPU profiles"). Its compute
sharing: ``python benchmarks/cpu_sharing.py`` on the same host. Its activation constants are the live
activation into a pooled worker with spare pages (a copy; ~0.085 s for 0.50 GiB). Other models,
dtypes or thread counts are not fitted (docs/results.md, "The CPU profiles", gives the errors for
SmolLM2-360M and bf16, measured with an earlier fit).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from prism_serve.sim.errors import SimConfigError

__all__ = [
    "HARDWARE",
    "HardwareProfile",
    "dump_hardware",
    "get_hardware",
    "host_cpu_profile",
    "load_hardware",
    "vector_class_profile",
]

GB = 1e9
GIB = 1 << 30


@dataclass(slots=True, frozen=True)
class HardwareProfile:
    name: str
    peak_flops: float  # dense bf16 FLOP/s (for the CPU profile: the fitted effective rate)
    mem_bandwidth: float  # bytes/s of device memory
    host_bandwidth: float  # bytes/s host -> device, one direction (model activation)
    link_bandwidth: float  # bytes/s device <-> device, one direction (tensor-parallel all-reduce)
    memory_bytes: int  # device memory
    usable_fraction: float = 0.9  # of memory_bytes models may map (weights + KV); the rest is runtime
    flops_efficiency: float = 0.6
    mem_efficiency: float = 0.9
    host_efficiency: float = 0.5  # pageable host memory, as Prism loads from
    step_overhead_s: float = 2e-4  # per engine step: launch and scheduling, not hidden by the roofline
    allreduce_latency_s: float = 1e-5  # per all-reduce (two per layer under TP)
    activation_overhead_s: float = 0.2  # engine start / page mapping before weights stream in
    overlap: bool = True  # True: step = max(compute, memory) (GPU); False: their sum (fitted CPU)
    # Terms only the fitted CPU profile sets (sim/cost.py); the defaults leave the roofline unchanged.
    # They are effective rates: the efficiency factors do not apply to them.
    attn_flops: float | None = None  # FLOP/s of attention; None: the matmuls' peak_flops * flops_efficiency
    kv_bandwidth: float | None = None  # bytes/s of KV reads and writes; None: mem_bandwidth * mem_efficiency
    row_bandwidth: float | None = None  # overlap=False only: weights streamed per row by small-batch GEMMs
    seq_overhead_s: float = 0.0  # per sequence that samples a token (sampling, detokenizing, bookkeeping)
    # True: batched decode attention reads every decode's context padded to the longest one of its
    # group, as this project's CPU attention does (engine/grouping.py); paged GPU kernels do not
    pad_decode_context: bool = False
    # Compute shared by engines busy at once on one device (share_slowdown): each step takes
    # n * (1 + share_interference * (n - 1)) times as long as alone. 0: processor sharing.
    share_interference: float = 0.0
    # Devices of one host that share its memory system (CPU devices are cores of one socket: one
    # memory bandwidth and last-level cache): each step takes (1 + cross_interference * k) times as
    # long while k other devices of the simulation have an engine step or activation copy in flight
    # (cross_slowdown). 0: devices do not slow each other (GPUs, each with its own memory).
    cross_interference: float = 0.0
    # The same two terms for decode steps of a given number of sequences, as measured on this
    # machine: (sequences, share_interference, cross_interference) entries, fewest sequences first.
    # A one-row decode streams the weights for one token and suffers most from another stream on
    # its core or its memory system; a wider batch or a prefill computes more per byte. A decode
    # step of b sequences takes the terms linear in b between the entries around it (the nearest
    # entry's outside them); a step with a prefill chunk, and every step while this is empty, takes
    # share_interference and cross_interference (``interference``). ``prism fit-hardware``
    # measures the entries (sim/sharing.py).
    decode_interference: tuple[tuple[int, float, float], ...] = ()
    # CPU devices that are every core of the host (a plan writes one device per core): while every
    # device has an engine step or activation copy in flight, the serving path (the server process,
    # its clients, the workers' own threads) takes its cores from the busy devices, and each step
    # runs 1 + serving_share times as long (serving_slowdown); with a device idle it runs there.
    # Measured on live step traces (fit_cpu_profile.py --trace, step_overlap.py serving_estimate:
    # wall over CPU time of steps with the other devices stepping, over the same with them idle).
    # 0: GPUs, whose host cores are not the devices.
    serving_share: float = 0.0
    # The serving path's part of every time to first token outside the engine (HTTP, tokenization,
    # the controller-worker hop, SSE framing), added to each simulated first token and finish; the
    # fitted CPU profiles measure it (sim_vs_live.py prints it for each live run), the GPU ones leave it 0
    request_overhead_s: float = 0.0
    # Threads that copy an activation's weights on the device's own compute (CPU devices: the
    # worker's loader threads, runtime load_threads, 4, on the device's cores). Each takes a busy
    # engine's share of the device while the copy runs (the OS schedules threads, not processes), so
    # the engines there slow down and the copy takes (busy engines + k) / k times its time alone.
    # 0: the copy leaves the device's compute to the engines (a GPU's copy is DMA over the host link).
    activation_threads: int = 0
    synthetic: bool = True  # constants from datasheets and assumptions, not measured here
    # The fit's relative errors on engine steps it was not fitted to (predicted / measured - 1, one
    # per held-out point; sim/fit.py): how far a simulated step may be from the machine's.
    # ``prism plan --confidence`` draws from them. Empty: none measured (the datasheet profiles).
    step_errors: tuple[float, ...] = ()
    # The same on other models' steps, by shape name (ModelShape.name; ``prism fit-hardware
    # --shapes``): a plan draws from these too for a deployment that serves that shape
    # (``errors_for``), and not for one that does not.
    shape_errors: tuple[tuple[str, tuple[float, ...]], ...] = ()
    # Per other shape (ModelShape name): (memory factor, compute factor, attention factor) by which
    # that model's weight pass, its matmuls and its attention (KV read and written, attention FLOPs)
    # take longer than the fitted rates price them: one core streams and multiplies matrices of
    # other widths at other rates, and runs attention of other head sizes and groupings at others.
    # ``prism fit-hardware --shapes`` measures them on three training steps of each shape (a one-row
    # decode, a 256-token prefill, a long-context decode; sim/fit.py); a shape not listed runs at the
    # fitted rates. An entry of two factors (a file written before the attention factor was
    # measured) runs its attention at the fitted rates.
    shape_scales: tuple[tuple[str, float, float, float], ...] = ()
    # Per shape (ModelShape name): (seconds, bytes/s, seconds) of its swaps on a one-core device of
    # this machine's runtime: the time around an activation's weight copy (the worker taking the
    # job, its pages granted and mapped or created, the engine built), the copy's own rate there,
    # and the time its eviction takes (the engine stopped, its pages unmapped), which an
    # activation on that device waits for. ``prism fit-hardware --shapes`` measures them
    # (sim/activations.py); a shape not listed is priced by activation_overhead_s and
    # host_bandwidth, which that fit sets to the medians, and evicts at once.
    shape_activations: tuple[tuple[str, float, float, float], ...] = ()
    # What the step constants were fitted to: "wall" (steps timed in a process of their own, as
    # ``prism fit-hardware`` times them, or a datasheet) or "cpu" (the stepping thread's CPU seconds
    # of live steps, fit_cpu_profile.py --trace). A live run's host speed is measured in the same
    # seconds (benchmarks/step_overlap.py ``host_speed``): on a VM a busy core gives its thread 95%
    # of the wall time, which a wall fit carries and a CPU fit does not.
    step_seconds: str = "wall"

    def __post_init__(self) -> None:
        def error(e: float) -> bool:  # predicted / measured - 1
            return math.isfinite(e) and e > -1

        # a profile file holds lists where the profile has tuples
        self._entries(
            "step_errors", lambda v: tuple(float(e) for e in v), "a list of numbers",
            lambda v: all(map(error, v)), "must be finite and > -1",
        )  # fmt: skip
        self._entries(
            "shape_errors", lambda v: tuple((str(n), tuple(float(e) for e in es)) for n, es in v),
            "[shape, [errors]] pairs", lambda v: all(error(e) for _, es in v for e in es),
            "must be finite and > -1",
        )  # fmt: skip
        self._entries(
            "shape_scales", lambda v: tuple(_scales(*e) for e in v),
            "[shape, memory factor, compute factor, attention factor] entries",
            lambda v: all(math.isfinite(f) and f > 0 for _, *fs in v for f in fs),
            "factors must be finite and > 0",
        )  # fmt: skip
        self._entries(
            "decode_interference",
            lambda v: tuple((_whole(b), float(sh), float(cr)) for b, sh, cr in v),
            "[sequences, share_interference, cross_interference] entries",
            lambda v: all(b >= 1 and 0 <= sh < math.inf and 0 <= cr < math.inf for b, sh, cr in v)
            and all(x[0] < y[0] for x, y in itertools.pairwise(v)),
            "needs sequences >= 1 in increasing order and terms finite and >= 0",
        )  # fmt: skip
        self._entries(
            "shape_activations",
            lambda v: tuple((str(n), float(t), float(r), float(e)) for n, t, r, e in v),
            "[shape, seconds, copy bytes/s, eviction seconds] lists",
            lambda v: all(
                math.isfinite(t) and t >= 0 and math.isfinite(r) and r > 0 and math.isfinite(e) and e >= 0
                for _, t, r, e in v
            ),
            "seconds must be finite and >= 0, copy rates finite and > 0",
        )  # fmt: skip
        if self.step_seconds not in ("wall", "cpu"):
            raise SimConfigError(
                f"hardware {self.name}: step_seconds must be 'wall' or 'cpu', not {self.step_seconds!r}"
            )
        positive = ("peak_flops", "mem_bandwidth", "host_bandwidth", "link_bandwidth", "memory_bytes")
        for name in positive:
            if not getattr(self, name) > 0:
                raise SimConfigError(f"hardware {self.name}: {name} must be > 0")
        for name in ("usable_fraction", "flops_efficiency", "mem_efficiency", "host_efficiency"):
            if not 0 < getattr(self, name) <= 1:
                raise SimConfigError(f"hardware {self.name}: {name} must be in (0, 1]")
        for name in (
            "step_overhead_s",
            "allreduce_latency_s",
            "activation_overhead_s",
            "seq_overhead_s",
            "share_interference",
            "cross_interference",
            "serving_share",
            "request_overhead_s",
        ):
            if getattr(self, name) < 0:
                raise SimConfigError(f"hardware {self.name}: {name} must be >= 0")
        for name in ("attn_flops", "kv_bandwidth", "row_bandwidth"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise SimConfigError(f"hardware {self.name}: {name} must be > 0 or None")
        if self.row_bandwidth is not None and self.overlap:
            raise SimConfigError(f"hardware {self.name}: row_bandwidth needs the summed form (overlap=False)")

    def _entries(self, field: str, parse, form: str, valid, rule: str) -> None:
        """``field`` set to ``parse`` of its value, or a SimConfigError naming it where the value
        does not have that ``form`` or is not ``valid`` (``rule`` says what)."""
        try:
            value = parse(getattr(self, field))
        except (TypeError, ValueError):
            raise SimConfigError(f"hardware {self.name}: {field} must be {form}") from None
        if not valid(value):
            raise SimConfigError(f"hardware {self.name}: {field} {rule}")
        object.__setattr__(self, field, value)

    def errors_for(self, shapes: Iterable[str]) -> tuple[float, ...]:
        """The measured step errors of a deployment of ``shapes`` (ModelShape names): the fitted
        model's, and those measured on each of its other shapes."""
        wanted = set(shapes)
        return self.step_errors + tuple(e for n, es in self.shape_errors if n in wanted for e in es)

    def scales_for(self, shape: str) -> tuple[float, float, float]:
        """(memory, compute, attention factors) of ``shape`` (a ModelShape name): 1s unless measured."""
        for name, memory, compute, attention in self.shape_scales:
            if name == shape:
                return memory, compute, attention
        return 1.0, 1.0, 1.0

    def activation_for(self, shape: str) -> tuple[float, float]:
        """(seconds around the copy, the copy's bytes/s) of activating ``shape`` (a ModelShape
        name): as measured for it (``shape_activations``), else the profile's overhead and host rate."""
        for name, seconds, rate, _ in self.shape_activations:
            if name == shape:
                return seconds, rate
        return self.activation_overhead_s, self.host_bandwidth * self.host_efficiency

    def eviction_for(self, shape: str) -> float:
        """Seconds an eviction of ``shape`` takes before its device can start an activation: as
        measured for it (``shape_activations``), else 0."""
        return next((e for name, _, _, e in self.shape_activations if name == shape), 0.0)

    def interference(self, decode_sequences: int = 0) -> tuple[float, float]:
        """(share_interference, cross_interference) of a step: for a decode step of
        ``decode_sequences`` sequences, from ``decode_interference`` where it has entries; for any
        other step (0: one with a prefill chunk), the profile's two terms."""
        table = self.decode_interference
        if decode_sequences <= 0 or not table:
            return self.share_interference, self.cross_interference
        if decode_sequences <= table[0][0]:
            return table[0][1], table[0][2]
        for (b0, s0, c0), (b1, s1, c1) in itertools.pairwise(table):
            if decode_sequences <= b1:
                w = (decode_sequences - b0) / (b1 - b0)
                return s0 + w * (s1 - s0), c0 + w * (c1 - c0)
        return table[-1][1], table[-1][2]

    def share_slowdown(self, num_busy: int, decode_sequences: int = 0) -> float:
        """The factor by which each busy engine's step time is multiplied while ``num_busy`` engines
        on this device have work (1.0 alone). The GPU profiles are processor sharing (n): their
        roofline step already saturates compute or memory bandwidth, so n concurrent steps share it.
        The CPU profile adds what its measured interference costs beyond time slicing, for a step of
        the given shape (``interference``)."""
        if num_busy <= 1:
            return 1.0
        return num_busy * (1.0 + self.interference(decode_sequences)[0] * (num_busy - 1))

    def cross_slowdown(self, other_busy_devices: int, decode_sequences: int = 0) -> float:
        """The factor by which a step (of the given shape, ``interference``) is multiplied while
        ``other_busy_devices`` other devices of the host have work (the memory system they share);
        1.0 for devices that share nothing."""
        return 1.0 + self.interference(decode_sequences)[1] * max(0, other_busy_devices)

    def serving_slowdown(self, every_device_busy: bool) -> float:
        """The factor by which a step is multiplied while ``every_device_busy`` (the serving path then
        takes its CPU from the devices' cores); 1.0 otherwise, and on the GPU profiles."""
        return 1.0 + self.serving_share if every_device_busy else 1.0

    def slowed(self, factor: float, compute_factor: float | None = None) -> HardwareProfile:
        """This profile with every engine step ``factor`` times as long (activation unchanged): a
        measured correction, e.g. the live engine's step seconds over the simulated ones. With
        ``compute_factor``, the compute rates (``peak_flops``, ``attn_flops``) are slowed by that
        instead, and ``factor`` slows the rest (memory and link traffic, per-step overheads): a host
        whose memory and cores run at different speeds (benchmarks/step_overlap.py measures both)."""
        compute = factor if compute_factor is None else compute_factor
        for f in (factor, compute):
            if not (f > 0 and math.isfinite(f)):
                raise SimConfigError(f"step scale must be a positive number, got {f}")

        def rate(v: float | None, f: float = factor) -> float | None:
            return None if v is None else v / f

        name = f"{self.name}-x{factor:g}" + ("" if compute_factor is None else f"-compute-x{compute:g}")
        return dataclasses.replace(
            self, name=name, peak_flops=self.peak_flops / compute,
            mem_bandwidth=self.mem_bandwidth / factor, link_bandwidth=self.link_bandwidth / factor,
            attn_flops=rate(self.attn_flops, compute), kv_bandwidth=rate(self.kv_bandwidth),
            row_bandwidth=rate(self.row_bandwidth), step_overhead_s=self.step_overhead_s * factor,
            seq_overhead_s=self.seq_overhead_s * factor,
            allreduce_latency_s=self.allreduce_latency_s * factor,
        )  # fmt: skip

    @property
    def capacity_bytes(self) -> int:
        """What DeviceSnapshot.capacity_bytes reports: memory models may use."""
        return int(self.memory_bytes * self.usable_fraction)

    @property
    def label(self) -> str:
        return (
            f"{self.name} ({'synthetic datasheet profile' if self.synthetic else 'fitted on this machine'})"
        )


HARDWARE: Mapping[str, HardwareProfile] = MappingProxyType(
    {
        p.name: p
        for p in (
            # H100 SXM5 80GB: 989 TFLOP/s dense bf16, 3.35 TB/s HBM3, PCIe Gen5 x16, NVLink 4 (450 GB/s/dir)
            HardwareProfile("h100", 989e12, 3.35e12, 64 * GB, 450 * GB, 80 * GIB),
            # H200 SXM 141GB: the H100's compute, 4.8 TB/s HBM3e
            HardwareProfile("h200", 989e12, 4.8e12, 64 * GB, 450 * GB, 141 * GB),
            # A100 SXM4 80GB: 312 TFLOP/s dense bf16, 2.04 TB/s HBM2e, PCIe Gen4 x16, NVLink 3
            HardwareProfile("a100", 312e12, 2.039e12, 32 * GB, 300 * GB, 80 * GIB),
            # Fitted (see above). "Bandwidth" and "FLOP/s" are effective rates of one core, so the
            # efficiencies are 1; the summed form adds the terms (one thread does one thing at a time).
            # Fitted on the engine before its fp32 linears moved to oneDNN (c5a0890): on an AVX2
            # host that change is not measured, so refit there (fit_cpu_profile.py).
            HardwareProfile(
                "cpu-smollm2",
                peak_flops=6.73e10,  # packed GEMMs (4+ rows)
                mem_bandwidth=1.00e10,  # the one weight pass of a packed GEMM
                # activation into a pooled worker with spare pages (memory/spare.py): a copy, no
                # page creation; live mean 0.076-0.091 s over 14 activations (sim_vs_live heavy-prism)
                host_bandwidth=7.0 * GB,
                link_bandwidth=2.0 * GB,  # unused: no tensor parallelism on CPU devices
                memory_bytes=8 * GIB,
                usable_fraction=1.0,
                flops_efficiency=1.0,
                mem_efficiency=1.0,
                host_efficiency=1.0,
                step_overhead_s=2.08e-2,  # Python and the small ops of 30 layers
                activation_overhead_s=0.01,
                overlap=False,
                attn_flops=6.04e10,
                kv_bandwidth=3.97e9,  # the gather of cached blocks before attention, then the read
                row_bandwidth=2.38e10,  # 1-3 rows: weights streamed once per row
                seq_overhead_s=1.30e-5,
                # the engine before its paged decode kernel (decodes gathered and padded by group);
                # not refitted on an AVX2 host since
                pad_decode_context=True,
                # benchmarks/cpu_sharing.py, 2026-11-24 on the host of the step constants: 2 / 3
                # engines on one core step 2.10x / 3.32x slower (median over decode 1, decode 8,
                # prefill 256; 2.08x / 3.13x on the 2026-11-23 host, a = 0.023), i.e. processor
                # sharing plus ~5% per extra engine (caches, switches). Devices of several cores
                # with one thread per core are not modelled: there OpenMP barriers spin while a
                # thread waits for a core, and 2 / 3 two-thread engines on 2 cores measured 3.4-7x /
                # 8-12x (benchmarks/cpu_sharing.py; docs/results.md, "The CPU profiles").
                share_interference=0.053,
                # live TTFT minus the request's own prefill step wall, requests whose prefill ran
                # alone: median 7.9 ms (p90 14 ms) on that host's light runs (docs/results.md)
                request_overhead_s=7.9e-3,
                activation_threads=4,  # the runtime's (runtime/loading.py LOAD_THREADS)
                step_seconds="cpu",  # fitted to live steps' CPU seconds
                synthetic=False,
            ),
            # The same engine and model on a host of the same VM type with AVX-512 and native bf16,
            # refitted 2026-11-26 after the engine's fp32 linears moved to oneDNN (c5a0890; prefill
            # steps 1.8x faster, decode steps about the same): two live training runs + 26
            # measured points (`fit_cpu_profile.py --trace ... --points ... --mem-bandwidth 1.95e10
            # --write`). Steps of one model cannot separate a per-step constant from the weight
            # pass, so the pass is fixed at one thread's oneDNN rate through weights larger than
            # the caches (19.5 GB/s, benchmarks/cpu_gemm.py), and the fit leaves no constant
            # beside it. Held-out live steps: mean |error| 6.8%, sum -3.8%; refitted the same day
            # on the steps that ran while the other core was idle (cross_interference below prices
            # the rest): 5.0%, -0.7% (peak_flops was 1.908e11, attn_flops 7.716e10, kv_bandwidth
            # 7.190e9). The fit before
            # (MKL kernels): peak_flops 9.256e10, mem_bandwidth 1.811e10, step_overhead_s 1.253e-2,
            # attn_flops 8.750e10, kv_bandwidth 6.432e9, row_bandwidth 3.222e10. Activation: the
            # copy at 16 GB/s (benchmarks/activation.py: 22-35 ms for SmolLM2's 0.50 GiB into spare
            # pages) plus 9 ms, the mean of 140 live activations in the qlm and heavy-prism runs
            # (decision to ready, 42.9 ms; pooled workers prepared, spare pages made at nice 19)
            HardwareProfile(
                "cpu-smollm2-avx512bf16",
                peak_flops=1.919e11,
                mem_bandwidth=1.95e10,
                host_bandwidth=16.0 * GB,
                link_bandwidth=2.0 * GB,
                memory_bytes=8 * GIB,
                usable_fraction=1.0,
                flops_efficiency=1.0,
                mem_efficiency=1.0,
                host_efficiency=1.0,
                step_overhead_s=0.0,
                activation_overhead_s=9e-3,
                overlap=False,
                attn_flops=7.666e10,
                # decode attention reads each context in place (engine/csrc/paged_decode.cpp, from
                # 2026-11-26): its KV term alone refitted on 28 measured decode points, every other
                # constant kept (`fit_cpu_profile.py --rounds 2 --refit-kv`; decode points' mean
                # |error| 16.5% -> 3.4%). Before, with decodes gathered and padded by group for
                # SDPA: kv_bandwidth 7.230e9, pad_decode_context True
                kv_bandwidth=1.217e10,
                row_bandwidth=None,
                seq_overhead_s=0.0,
                pad_decode_context=False,
                # benchmarks/cpu_sharing.py --rounds 2 on this host after the refit: 2 / 3 engines on
                # one core step 2.32x / 3.50x slower (median over decode 1, decode 8, prefill 256),
                # a = 0.090 (0.053 with the MKL kernels): oneDNN's steps lose more to a neighbour
                share_interference=0.090,
                # its two cores share one memory system: fit_cpu_profile.py --trace on the light and
                # heavy training runs, steps that had their core but ran while the other core stepped
                # cost 1.146x the CPU of those with it idle (decode 1.160x, prefill 1.088x; 798 / 3,333
                # steps); those steps are left out of the constants above
                cross_interference=0.146,
                # a live run's step traces on an AVX-512 host of this CPU model, 2026-12-01 (plan_live.py's
                # "three" at 1x on 2 devices, PRISM_STEP_TRACE; fit_cpu_profile.py --trace DIR): steps with
                # the other core stepping last 1.029x the wall over CPU of those with it idle (984 / 149
                # steps), the cores the server, the client and the workers' threads take once none is idle
                serving_share=0.029,
                # the same measure on this host's light training runs: median 6.3 ms (p90 9.6 ms)
                # before the refit, 7.5 ms (p90 12.0 ms) after it
                request_overhead_s=7.5e-3,
                activation_threads=4,  # the runtime's (runtime/loading.py LOAD_THREADS)
                step_seconds="cpu",  # fitted to live steps' CPU seconds
                synthetic=False,
            ),
        )
    }
)


def _whole(value: object) -> int:
    """A count read from a profile file: an int, or a float with no fractional part."""
    number = float(value)  # type: ignore[arg-type]
    if not number.is_integer():
        raise ValueError(f"{value!r} is not a whole number")
    return int(number)


def _scales(
    name: object, memory: object, compute: object, attention: object = 1.0
) -> tuple[str, float, float, float]:
    """One shape_scales entry; an older file's (shape, memory, compute): attention at the fitted rates."""
    return str(name), float(memory), float(compute), float(attention)  # type: ignore[arg-type]


def vector_class_profile() -> str:
    """cpu-smollm2-avx512bf16, cpu-smollm2-avx512 or cpu-smollm2-avx2: the name a CPU profile of this
    machine's vector class has, which decides how fast its matmuls are (VMs sold as one CPU model
    come with either)."""
    from prism_serve.engine.machine import cpu_flags, native_bf16

    flags = cpu_flags()
    if native_bf16(flags):
        return "cpu-smollm2-avx512bf16"
    if "avx512f" in flags:
        return "cpu-smollm2-avx512"
    return "cpu-smollm2-avx2" if "avx2" in flags else "cpu-smollm2-other"


def host_cpu_profile() -> str:
    """The registered CPU profile fitted on a CPU of this machine's vector class, else cpu-smollm2
    (fitted on an AVX2-only host; on another class, fit one: ``prism fit-hardware``)."""
    name = vector_class_profile()
    return name if name in HARDWARE else "cpu-smollm2"


def get_hardware(name: str) -> HardwareProfile:
    """A registered profile by name, or a profile file (a path ending in ``.json``: what
    ``prism fit-hardware`` or ``benchmarks/fit_cpu_profile.py --write`` produces for the machine it
    ran on)."""
    if name in HARDWARE:
        return HARDWARE[name]
    if name.endswith(".json"):
        return load_hardware(Path(name))
    raise SimConfigError(
        f"unknown hardware {name!r}; choose one of {', '.join(HARDWARE)} or give a profile file (*.json)"
    )


def load_hardware(path: Path) -> HardwareProfile:
    """A profile written as JSON (``dataclasses.asdict`` of a HardwareProfile). Every field is
    checked as for a registered profile; a missing required field or an unknown one is an error."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise SimConfigError(f"hardware profile {str(path)!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise SimConfigError(f"hardware profile {str(path)!r} is not JSON: {e}") from None
    if not isinstance(data, dict):
        raise SimConfigError(f"hardware profile {str(path)!r} must be a JSON object")
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(data) - fields)
    if unknown:
        raise SimConfigError(f"hardware profile {str(path)!r}: unknown fields {', '.join(unknown)}")
    try:
        return HardwareProfile(**data)
    except TypeError as e:  # a required field missing
        raise SimConfigError(f"hardware profile {str(path)!r}: {e}") from None


def dump_hardware(profile: HardwareProfile, path: Path) -> None:
    """Write ``profile`` as a file that ``get_hardware(str(path))`` reads back equal."""
    path.write_text(json.dumps(dataclasses.asdict(profile), indent=1) + "\n")
