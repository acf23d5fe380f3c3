"""A sampling profiler of the trainer's threads (trainer.sample_stacks_ms): where the host's wall
time goes at the Python level from `main` to the end, start-up and step 1 included, which
torch.profiler (ops of the profiled steps) and dynamo's phase clocks (compiles only) leave out.

Every interval a daemon thread reads every thread's stack (sys._current_frames) and adds the
wall time since its previous sample to each, under the phase the run is in: the last start-up
mark reached ("since main", "since parallelized", ...: step 1 is in "since parallelized"). A
thread that holds the GIL in a long C call delays the next sample; the delay still goes to the
stack it was in, so the main thread's seconds add up to the sampled wall time. The sampler
takes the GIL once per interval for well under a millisecond: at 5 ms, the measured steps lose
about a percent to it.

Written per rank as collapsed stacks, `<phase>;[<thread>];<file>:<function>;... <seconds>`
(outermost frame first), which flamegraph tools read; `python bench/stacks_summary.py FILE`
prints the functions with the most inclusive and self time of each phase.
"""

from __future__ import annotations

import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from types import FrameType


def frame_label(frame: FrameType) -> str:
    """`torch/_inductor/codecache.py:load`: an installed package's file from its package down,
    ours from `moe_perf/` down (a checkout or an arm's worktree), any other by its name."""
    path, name = frame.f_code.co_filename, frame.f_code.co_name
    if name == "__call__" and path.endswith("torch/_ops.py"):
        # a C++ op's time shows here alone: name the op (`torch/_ops.py:__call__ aten.mm.default`)
        name = f"__call__ {frame.f_locals.get('self', '')}"
    for root in ("site-packages/", "dist-packages/"):
        if root in path:
            return f"{path.rsplit(root, 1)[1]}:{name}"
    parts = Path(path).parts
    ours = [i for i, part in enumerate(parts) if part == "moe_perf"]
    return f"{'/'.join(parts[ours[-1] :] if ours else parts[-1:])}:{name}"


class StackSampler:
    """Samples every Python thread but its own every `interval_ms` until stop(); `phase` is a
    callable giving the current phase's name. seconds[(phase, frames)] is the wall time seen,
    frames[0] naming the thread: `[main]`, its name (`[Thread-3 (worker)]`), or `[unnamed
    thread]` for one Python did not start, such as autograd's device thread running a compiled
    backward. Only the main thread's seconds add up to the wall time: a waiting thread's
    stack collects its waits too."""

    def __init__(self, interval_ms: float, phase):
        self.interval_s = interval_ms / 1000
        self.phase = phase
        self.main = threading.get_ident()
        self.seconds: dict[tuple[str, tuple[str, ...]], float] = defaultdict(float)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moe_perf-stacks", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        me, last = threading.get_ident(), time.perf_counter()
        while not self._stopped.wait(self.interval_s):
            now, phase = time.perf_counter(), self.phase()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                frames = []
                while frame is not None:
                    frames.append(frame_label(frame))
                    frame = frame.f_back
                thread = "main" if ident == self.main else names.get(ident, "unnamed thread")
                self.seconds[(phase, (f"[{thread}]", *reversed(frames)))] += now - last
            last = now

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join()

    def write(self, path: Path) -> None:
        """Collapsed stacks, one per line, the heaviest first."""
        path.parent.mkdir(parents=True, exist_ok=True)
        rows = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        path.write_text("".join(f"{';'.join((p, *f))} {s:.6f}\n" for (p, f), s in rows))


def start(interval_ms: float, marks: dict[str, float]) -> StackSampler | None:
    """A sampler of this thread whose phase is "since <the last of `marks`>" (a Timeline's
    marks, filled as the run goes); None when interval_ms is 0 (off)."""
    if interval_ms <= 0:
        return None
    return StackSampler(interval_ms, lambda: f"since {next(reversed(marks), 'start')}")
