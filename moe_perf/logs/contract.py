"""trainer.log_format=contract: `[moe_perf] step=k/N step_time_s=... tokens_per_s=...
peak_mem_gib=...`, global tokens/s, from one rank (docs/trainer-contract.md)."""

from __future__ import annotations

from moe_perf.common.contract import parse_step
from moe_perf.logs.base import LogFormat, Steps
from moe_perf.logs.steps import RunShape, as_known


class ContractFormat(LogFormat):
    """Taken as printed, rank 0 only: the figures already mean what the contract says, so
    nothing is combined or derived. A step beyond the line's own `/N` is a problem."""

    name = "contract"
    first_words = "[moe_perf] step=k/N ..."
    every_rank_prints = False  # the others' lines are console.log only

    def parse(self, text: str) -> dict | None:
        return parse_step(text)

    def no_steps(self) -> str:
        return "no metrics: the trainer printed no '[moe_perf] step=' lines"

    def who(self, rank: int | None, line: str) -> tuple | None:
        # one rank prints: its lines are in order even without a prefix
        return ("", rank)

    def check(self, who: tuple | None, raw: dict, shape: RunShape, problems: list[str]) -> None:
        if raw["step"] > raw["max_steps"]:
            problems.append(f"step {raw['step']} is beyond its own /{raw['max_steps']}")

    def add(self, raws: dict[int, list[dict]], raw: dict, shape: RunShape) -> dict | None:
        raws[raw["step"]] = [as_known(raw)]
        return raw

    def steps(self, raws: dict[int, list[dict]], shape: RunShape) -> Steps:
        samples = [raws[k][0] for k in sorted(raws)]
        return Steps(samples, [], [], len(samples))
