"""Timing as specified in shared benchmarking rules: cold/hot CUDA-graph replay, host time, and a
device-to-device copy ceiling measured in the same run."""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Callable

import torch

L2_FLUSH_BYTES = 512 << 20  # > 8x the H200's 60 MB L2


class Timer:
    def __init__(self, replays: int = 50) -> None:
        self.replays = replays
        self._flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.uint8, device="cuda")

    def flush_l2(self) -> None:
        self._flush.fill_(1)

    def _graph(self, fn: Callable[[], None], calls: int) -> torch.cuda.CUDAGraph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()  # warm: compile/load outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(calls):
                fn()
        torch.cuda.synchronize()
        return graph

    def _replay_us(self, graph: torch.cuda.CUDAGraph, flush: bool, reps: int) -> float:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(reps):
            if flush:
                self.flush_l2()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        return statistics.median(samples)

    def cold_us(self, fn: Callable[[], None]) -> float:
        """One call in a CUDA graph, L2 flushed before each replay; median over replays."""
        graph = self._graph(fn, 1)
        self._replay_us(graph, True, 5)
        return self._replay_us(graph, True, self.replays)

    def hot_us(self, fn: Callable[[], None], calls: int = 20) -> float:
        """``calls`` back-to-back calls in one graph, replay time / calls (L2 warm)."""
        graph = self._graph(fn, calls)
        self._replay_us(graph, False, 5)
        return self._replay_us(graph, False, max(10, self.replays // 3)) / calls

    def eager_cold_us(self, fn: Callable[[], None], reps: int = 15) -> float:
        """For baselines that cannot be graph-captured (data-dependent shapes): events around
        one eager call after an L2 flush, launch overhead included; median."""
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        samples = []
        for _ in range(reps):
            self.flush_l2()
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) * 1e3)
        return statistics.median(samples)


def baseline_error(exc: BaseException) -> str:
    """One line saying why a baseline could not run (recorded in place of its time): the last
    ``...Error: ...`` line of the message (Inductor wraps the worker's error in advice)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"[\w.]*(Error|Exception): ", line)
              and "TORCHDYNAMO_VERBOSE" not in line]
    last = errors[-1] if errors else (lines[-1] if lines else "")
    return f"{type(exc).__name__}: {last}"[:160]


def copy_ceiling_bytes_per_s(nbytes: int = 1 << 30, reps: int = 10) -> float:
    """Device-to-device ``copy_`` of ``nbytes``; bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda").fill_(3)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / reps
    return 2 * nbytes / seconds


def environment() -> dict:
    import cutlass

    props = torch.cuda.get_device_properties(0)
    driver = "unknown"
    try:
        import subprocess

        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()
    except Exception:
        pass
    return {
        "gpu": props.name,
        "sms": props.multi_processor_count,
        "driver": driver,
        "torch": torch.__version__,
        "cutlass_dsl": cutlass.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }


def host_us(fn: Callable[[], None], calls: int = 200, reps: int = 5) -> float:
    """Wall time per eager call of the host alone: ``calls`` back-to-back calls with the GPU
    idle at the start, timed up to the last call's return (not to the GPU's end, which would
    time the kernels whenever they run longer than their launches; 200 launches stay far below
    the driver's queue depth, so none waits for the GPU); best of ``reps``."""
    fn()
    samples = []
    for _ in range(reps):
        torch.cuda.synchronize()
        begin = time.perf_counter()
        for _ in range(calls):
            fn()
        samples.append((time.perf_counter() - begin) / calls * 1e6)
    torch.cuda.synchronize()
    return min(samples)


class HostRounds:
    """The host time of a few small calls, measured again in rounds spread over a ``make perf``
    run: the GPU machine's host changes speed by up to a third from one minute to the next (a
    co-tenant; ``torch``'s own ``x.add_(1)`` moves as much), so a cell's one measurement may
    land in a slow minute. Each round times every call with :func:`host_us`; a cell's host time
    is the best of its own measurement and the rounds'."""

    def __init__(self, calls: dict[tuple, Callable[[], None]]) -> None:
        self.calls = calls  # (kernel, format, tokens) -> the call
        self.samples: dict[tuple, list[float]] = {key: [] for key in calls}

    def round(self) -> None:
        for key, call in self.calls.items():
            self.samples[key].append(host_us(call))

    def apply(self, rows: list[dict]) -> None:
        """Each measured row's ``host_us`` becomes the best of it and the rounds', which are
        kept as ``host_rounds_us``."""
        for row in rows:
            samples = self.samples.get((row["kernel"], row["format"], row["tokens"]))
            if samples:
                row["host_rounds_us"] = [round(s, 2) for s in samples]
                row["host_us"] = min(row["host_us"], *samples)
