"""The device's context created while the trainer imports (trainer.early_cuda_context).

A warm arm's first seconds are serial: torch's import, then the trainer's (dynamo's among
them, about 1 s), then the CUDA context (0.48 s on an H100), then the build. The context needs
only torch and the rank's device, so `start` creates it in a thread as soon as torch is
imported, while the main thread imports the rest; the build's first CUDA call then finds it
made (torch's lazy initialisation is guarded by its own lock, so a main thread that gets there
first waits for it, never makes a second). Only the driver's calls can overlap the imports:
where torch holds the GIL through them, the thread gains nothing, which the benchmark shows
(bench/gpu_time_to_decision.sh).

`start` runs before `moe_perf.trainer.train` is imported, so it reads the config itself; a
config it cannot read starts nothing and `train.main` reports the problem.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from moe_perf.common.config import gpu_expected, load_config
from moe_perf.trainer.clock import HelperThread, process_age_s

EARLY_CONTEXT_THREAD = "moe_perf-early-cuda-context"


@dataclass
class EarlyContext(HelperThread):
    """The thread making the context: its device and when it started (seconds since the
    process started), beside what every start-up helper records."""

    device: int = 0
    started_s: float | None = None

    def summary(self) -> dict:
        return {"device": self.device, "started_s": self.started_s, **super().summary()}


def wanted(argv: list[str]) -> bool:
    """Whether the config (argv: CONFIG.yaml [overrides]) asks for the early context on a GPU."""
    try:
        cfg = load_config(argv[0], argv[1:])
    except Exception:  # train.main reads it again and says what is wrong
        return False
    if not cfg.trainer.early_cuda_context or not gpu_expected(cfg.training.device):
        return False  # torch's import stays where it was
    import torch  # only now: with the switch off, the imports stay as without it

    return torch.cuda.is_available()


def start(argv: list[str]) -> EarlyContext | None:
    """The context of this rank's device (LOCAL_RANK) made in a thread, or None when the
    config does not ask for it or no GPU is there."""
    if not argv or not wanted(argv):
        return None
    import torch  # imported by `wanted` already

    device = int(os.environ.get("LOCAL_RANK", 0))

    def make() -> None:
        t0 = time.perf_counter()
        try:
            torch.cuda.init()
            with torch.cuda.device(device):  # the primary context of this rank's device
                torch.empty(1, device=f"cuda:{device}")
        except Exception as e:  # the build makes the same calls and reports them
            early.error = f"{type(e).__name__}: {e}"
        early.seconds = round(time.perf_counter() - t0, 3)

    thread = threading.Thread(target=make, name=EARLY_CONTEXT_THREAD, daemon=True)
    early = EarlyContext(thread, device=device, started_s=round(process_age_s(), 3))
    early.thread.start()
    return early
