"""Prints how many `torch.cuda._sleep` cycles spin the GPU for MS milliseconds, measured here.

    python bench/gpu_spin_cycles.py MS

Used by the planted-slowdown benches: a spin on the GPU stream is not hidden behind queued GPU
work the way a host sleep is.
"""

import sys

import torch


def spin_cycles(ms: float, probe: int = 10_000_000) -> int:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(probe)  # the first launch warms up
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    torch.cuda.synchronize()
    return int(probe * ms / start.elapsed_time(end))


if __name__ == "__main__":
    print(spin_cycles(float(sys.argv[1])))
