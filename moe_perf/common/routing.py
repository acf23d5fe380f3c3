"""Routing beyond perfect balance: what `routing=skew` asks for, as exact per-expert counts.

Pure Python, read by both worlds: the trainer sends tokens by a plan (trainer/routing.py),
torchtitan's in-rank entry does the same inside torchtitan's router (titan_entry.py), the
memory pre-flight sizes the busiest rank by it (memory.py) and the report shows it beside what
was measured (report/imbalance.py). docs/routing.md says what each mode means.

A skew plan is made for one micro-batch on one rank: T tokens, T*K (token, k) slots, E experts.

* `imbalance` r = the busiest expert's slots over the mean T*K/E. An expert takes a token at
  most once (top-k distinct), so it gets at most T slots: r <= E/K.
* `shape` orders the experts' counts from the busiest down:
  `hot`   `hot_experts` experts at r x mean each, the others share the rest evenly;
  `zipf`  count of the j-th busiest proportional to (j+1)^-s, s solved so that the first is
          r x mean (s = 0 is balance; larger s, steeper).
* `hot_ranks` places them: the busiest h*L experts (L = E/ep per EP rank) fill the first h EP
  ranks, dealt round-robin over them, the rest likewise over the other ranks. h = 1 puts the
  hot experts on one rank (a straggler); h = ep spreads them as evenly as ranks allow.

The slots are dealt column-major: the experts' slots in expert order, expert e repeated
counts[e] times, fill column 0 of a T x K table top to bottom, then column 1, ... An expert's
run of at most T consecutive positions lands in distinct rows, so every token gets K distinct
experts, and every expert gets exactly its count. Token i of the micro-batch takes row
(global token index) mod T: each micro-batch of each rank is one whole period, so every rank,
micro-batch and step sees exactly the planned counts, the same in both arms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

MODES = ("balanced", "skew", "real")
SHAPES = ("hot", "zipf")
# The plan is made of whole slot counts; a request it cannot meet within this (relative) is
# refused rather than run under a tag that names another imbalance.
PLAN_TOLERANCE = 0.01


class RoutingError(ValueError):
    """A routing request no plan can meet; the message names the override to change."""


@dataclass(frozen=True)
class SkewPlan:
    """Slots per expert (by expert id) in one micro-batch on one rank of T tokens, top-K."""

    counts: tuple[int, ...]
    tokens: int  # T: tokens of one micro-batch on one rank (the period of the table)
    top_k: int
    ep: int

    @property
    def num_experts(self) -> int:
        return len(self.counts)

    @property
    def expert_imbalance(self) -> float:
        """The busiest expert's slots over the mean (1.0 = balanced)."""
        return max(self.counts) * self.num_experts / (self.tokens * self.top_k)

    def rank_loads(self) -> tuple[int, ...]:
        """Slots each EP rank's experts get from one micro-batch of one rank (experts
        [r*E/ep, (r+1)*E/ep) on rank r). Every rank of an EP group sends the same counts, so a
        rank receives ep times this."""
        per_rank = self.num_experts // self.ep
        return tuple(sum(self.counts[r * per_rank : (r + 1) * per_rank]) for r in range(self.ep))

    @property
    def rank_imbalance(self) -> float:
        """The busiest EP rank's slots over the mean."""
        loads = self.rank_loads()
        return max(loads) * len(loads) / sum(loads)

    def slot_ends(self) -> list[int]:
        """End (exclusive) of each expert's run of positions p = k*T + t: the expert of
        position p is the number of ends <= p (a sorted search)."""
        return [sum(self.counts[: e + 1]) for e in range(self.num_experts)]

    def table(self) -> list[list[int]]:
        """The K experts of each of the T rows (for tests and readers; the trainers search
        `slot_ends` instead of holding the table)."""
        flat = [e for e, c in enumerate(self.counts) for _ in range(c)]
        T = self.tokens
        return [[flat[k * T + t] for k in range(self.top_k)] for t in range(T)]


# ---- the shapes: counts from the busiest expert down ----------------------------------------


def _even_split(total: int, parts: int) -> list[int]:
    """`total` over `parts` as evenly as whole numbers allow, larger ones first."""
    base, extra = divmod(total, parts)
    return [base + (1 if i < extra else 0) for i in range(parts)]


def hot_profile(slots: int, E: int, imbalance: float, hot_experts: int) -> list[int]:
    if hot_experts >= E:  # every expert hot: balance (check_request allows it at 1.0 only)
        return _even_split(slots, E)
    hot = round(imbalance * slots / E)
    return [hot] * hot_experts + _even_split(slots - hot_experts * hot, E - hot_experts)


def zipf_exponent(E: int, imbalance: float) -> float:
    """s with E * 1 / sum_j (j+1)^-s = imbalance (the first of E Zipf weights over their
    mean), by bisection: the ratio rises from 1 (s = 0) towards E."""
    low, high = 0.0, 64.0
    for _ in range(200):
        mid = (low + high) / 2
        ratio = E / sum((j + 1) ** -mid for j in range(E))
        low, high = (mid, high) if ratio < imbalance else (low, mid)
    return (low + high) / 2


def zipf_profile(slots: int, E: int, imbalance: float) -> list[int]:
    """The busiest at round(imbalance x mean); the rest split by largest remainder of their
    Zipf weights (so the counts sum to `slots` exactly)."""
    s = zipf_exponent(E, imbalance)
    first = round(imbalance * slots / E)
    weights = [(j + 1) ** -s for j in range(1, E)]
    shares = [(slots - first) * w / sum(weights) for w in weights]
    counts = [math.floor(x) for x in shares]
    by_remainder = sorted(range(E - 1), key=lambda j: counts[j] - shares[j])
    for j in by_remainder[: slots - first - sum(counts)]:
        counts[j] += 1
    return [first, *counts]


# ---- placement and the plan ------------------------------------------------------------------


def placement(E: int, ep: int, hot_ranks: int) -> list[int]:
    """Expert id of the j-th busiest expert: the first hot_ranks*L dealt round-robin over EP
    ranks 0..hot_ranks-1, the rest over the other ranks (L = E/ep experts per rank)."""
    per_rank = E // ep
    ids = []
    for j in range(E):
        first_ranks, ranks, i = 0, hot_ranks, j
        if j >= hot_ranks * per_rank:
            first_ranks, ranks, i = hot_ranks, ep - hot_ranks, j - hot_ranks * per_rank
        ids.append((first_ranks + i % ranks) * per_rank + i // ranks)
    return ids


def check_request(E: int, K: int, ep: int, imbalance: float, shape: str, hot_experts: int,
                  hot_ranks: int) -> None:  # fmt: skip
    """What no plan can meet, whatever the batch: one message naming the override."""
    if shape not in SHAPES:
        raise RoutingError(f"routing.shape={shape}: expected one of {', '.join(SHAPES)}")
    if not 1 <= imbalance <= E / K:
        raise RoutingError(
            f"routing.imbalance={imbalance:g} must be in 1..E/K = {E}/{K} = {E / K:g} (a token "
            f"takes an expert at most once, so the busiest gets at most every token); change "
            f"routing.imbalance"
        )
    if not 1 <= hot_ranks <= ep:
        raise RoutingError(f"routing.hot_ranks={hot_ranks} must be in 1..mesh.ep={ep}; change "
                           f"routing.hot_ranks")  # fmt: skip
    if shape == "hot" and not 1 <= hot_experts <= E:
        raise RoutingError(f"routing.hot_experts={hot_experts} must be in 1..model.num_experts="
                           f"{E}; change routing.hot_experts")  # fmt: skip
    if shape == "hot" and hot_experts * imbalance > E:
        raise RoutingError(
            f"routing.hot_experts={hot_experts} x routing.imbalance={imbalance:g} > "
            f"model.num_experts={E}: the hot experts would take more than every slot; lower "
            f"routing.imbalance or routing.hot_experts"
        )


def _check_plan(plan: SkewPlan, imbalance: float) -> None:
    if max(plan.counts) > plan.tokens:
        raise RoutingError(
            f"routing.imbalance={imbalance:g}: the busiest expert would need "
            f"{max(plan.counts)} of a micro-batch's {plan.tokens} tokens on one rank; lower "
            f"routing.imbalance"
        )
    if abs(plan.expert_imbalance - imbalance) > PLAN_TOLERANCE * imbalance:
        raise RoutingError(
            f"routing.imbalance={imbalance:g} cannot be planned within {PLAN_TOLERANCE:.0%} "
            f"with {plan.tokens * plan.top_k / plan.num_experts:g} slots per expert in a "
            f"rank's micro-batch (nearest: {plan.expert_imbalance:.4g}); change "
            f"routing.imbalance, or raise training.micro_batch or training.sequence_length"
        )


@cache
def skew_plan(*, num_experts: int, top_k: int, tokens: int, ep: int, imbalance: float,
              shape: str = "hot", hot_experts: int = 1,
              hot_ranks: int = 1) -> SkewPlan:  # fmt: skip
    """The plan for one micro-batch of `tokens` tokens on one rank; RoutingError (naming the
    override) when the request cannot be met."""
    E, K = num_experts, top_k
    check_request(E, K, ep, imbalance, shape, hot_experts, hot_ranks)
    slots = tokens * K
    if shape == "hot":
        profile = hot_profile(slots, E, imbalance, hot_experts)
    else:
        profile = zipf_profile(slots, E, imbalance)
    counts = [0] * E
    for count, expert in zip(profile, placement(E, ep, hot_ranks), strict=True):
        counts[expert] = count
    plan = SkewPlan(tuple(counts), tokens, K, ep)
    _check_plan(plan, imbalance)
    return plan


def imbalance_text(imbalance: float) -> str:
    """`2.0`, `1.5`, `1.25`: one decimal at least, no float noise."""
    return f"{imbalance:.1f}" if round(imbalance, 1) == imbalance else f"{imbalance:g}"


def tag_suffix(mode: str, imbalance: float, shape: str, hot_experts: int,
               hot_ranks: int) -> str:  # fmt: skip
    """What the tag adds for non-balanced routing, so that results never mix: `` (balanced),
    `-real`, `-skew2.0`, with `-zipf`, `-hot4` (hot experts) and `-ranks2` (hot ranks) where
    they differ from the defaults (hot, 1, 1)."""
    if mode == "balanced":
        return ""
    if mode == "real":
        return "-real"
    text = f"-skew{imbalance_text(float(imbalance))}"
    if shape != "hot":
        text += f"-{shape}"
    elif int(hot_experts) != 1:
        text += f"-hot{int(hot_experts)}"
    return text + (f"-ranks{int(hot_ranks)}" if int(hot_ranks) != 1 else "")
