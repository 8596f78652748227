"""Device-side timing helpers shared by the GPU benchmarks (not tests).

JAX: one jitted program runs the operation R times back to back, each on its own input and weight
buffers: distinct operands keep XLA from merging identical calls (CSE) and keep weights out of
L2; per-call time = median over repeats of the wall time of the whole program (synchronised) / R,
after a warm-up.
torch: CUDA events around R calls on the same rotating inputs.
"""

from __future__ import annotations

import statistics
import time

import jax

BUDGET_BYTES = 6 << 30  # operands of one timed program


def repetitions(operand_bytes: int, wanted: int) -> int:
    """As many distinct operand sets as wanted, within the memory budget (at least 3)."""
    return max(3, min(wanted, BUDGET_BYTES // max(operand_bytes, 1)))


def time_jax(fn, xs, ws, repeats: int = 5) -> float:
    """Seconds per call of ``fn(x, w)`` over the distinct pairs ``zip(xs, ws)`` in one program."""
    reps = len(ws)
    assert len(xs) == reps

    @jax.jit
    def program(xs, ws):
        return [fn(x, w) for x, w in zip(xs, ws)]

    jax.block_until_ready(program(xs, ws))  # compile + warm-up
    jax.block_until_ready(program(xs, ws))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(program(xs, ws))
        samples.append((time.perf_counter() - t0) / reps)
    return statistics.median(samples)


def time_torch(fn, xs, ws, repeats: int = 5) -> float:
    import torch

    reps = len(ws)
    for i in range(3):
        fn(xs[i], ws[i])
    torch.cuda.synchronize()
    samples = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for x, w in zip(xs, ws):
            fn(x, w)
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(samples)


def kernel_times(run) -> dict[str, list[int]]:
    """GPU kernels CUPTI records while ``run()`` executes: ``{kernel name: [launches, total ns]}``.
    CUPTI sees every kernel of the process (XLA's, our FFI handlers' and torch's alike)."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(files[0])
        kernels: dict[str, list[int]] = {}
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            lines = list(plane.lines)
            # Kernels sit on per-stream lines; "XLA Ops"/"XLA Modules" lines summarise the same time.
            streams = [ln for ln in lines if "stream" in ln.name.lower()] or [
                ln for ln in lines if "xla" not in ln.name.lower() and "launch" not in ln.name.lower()]
            for ln in streams:
                for e in ln.events:
                    entry = kernels.setdefault(e.name, [0, 0])
                    entry[0] += 1
                    entry[1] += e.duration_ns
    return kernels


def kernel_sequence(run) -> list[tuple[int, int, str]]:
    """The GPU kernels CUPTI records while ``run()`` executes, in launch order: ``[(start ns,
    duration ns, name)]`` of the busiest stream (a decode step's chain of kernels, to read one
    layer's launches and the gaps between them)."""
    import glob
    import tempfile

    from jax.profiler import ProfileData

    with tempfile.TemporaryDirectory() as tmp:
        jax.profiler.start_trace(tmp)
        try:
            run()
        finally:
            jax.profiler.stop_trace()
        files = glob.glob(f"{tmp}/**/*.xplane.pb", recursive=True)
        data = ProfileData.from_file(files[0])
        best: list[tuple[int, int, str]] = []
        for plane in data.planes:
            if not plane.name.startswith("/device:GPU"):
                continue
            for ln in plane.lines:
                if "stream" not in ln.name.lower():
                    continue
                events = [(e.start_ns, e.duration_ns, e.name) for e in ln.events]
                if len(events) > len(best):
                    best = events
    return sorted(best)


def device_seconds(run, reps: int) -> float:
    """GPU busy time per call: the sum of all kernel durations while ``run()`` executes ``reps``
    calls, divided by ``reps``. Unlike wall time this excludes host launch gaps, so JAX programs and
    eager torch are compared on what the GPU actually spent."""
    total = sum(ns for _, ns in kernel_times(run).values())
    if total == 0:
        raise RuntimeError("no GPU kernel events were recorded")
    return total / 1e9 / reps


def device_time_jax(fn, xs, ws) -> float:
    program = jax.jit(lambda xs, ws: [fn(x, w) for x, w in zip(xs, ws)])
    jax.block_until_ready(program(xs, ws))
    jax.block_until_ready(program(xs, ws))
    return device_seconds(lambda: jax.block_until_ready(program(xs, ws)), len(ws))


def device_time_torch(fn, xs, ws) -> float:
    import torch

    for x, w in zip(xs[:3], ws[:3]):
        fn(x, w)
    torch.cuda.synchronize()

    def run():
        for x, w in zip(xs, ws):
            fn(x, w)
        torch.cuda.synchronize()

    return device_seconds(run, len(ws))
