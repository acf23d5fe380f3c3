"""explain=true's one config rule: how many steps each arm profiles. The runner writes it into
the arm's config (trainer.explain_steps); the torchtitan and Megatron adapters turn it into
their trainers' own profiler flags."""

from __future__ import annotations

from typing import Any

# profiled steps per arm when `explain=true` and the trainer sets none; the first is dropped
EXPLAIN_STEPS = 4


def explain_steps(cfg: Any) -> int:
    """Profiled steps per arm: 0 unless `explain=true` (then the trainer's own, or
    EXPLAIN_STEPS)."""
    if not cfg.get("explain", False):
        return 0
    return int(cfg.trainer.get("explain_steps") or EXPLAIN_STEPS)
