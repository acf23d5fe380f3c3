"""Mesh arithmetic shared by the runner (before launch) and the trainer (at start-up).

One value object owns pp, cp, ep, the world size and the inferred dp, and checks every
prerequisite of a run. Its errors show the arithmetic and name the override to change.
Pure Python: importable without torch or Hydra.
"""

from __future__ import annotations

from dataclasses import dataclass


class MeshError(ValueError):
    """A mesh, batch or sequence setting that cannot run; the message names the override."""


def check_microbatches(n_micro: int, pp: int, arithmetic: str = "") -> None:
    """Micro-batches per rank and step >= pp when pp > 1: torch's Schedule1F1B refuses fewer
    micro-batches than stages, and with fewer any schedule leaves stages idle. The one message
    for this, used by `MeshDims.check_batch` (runner and trainer) and by the trainer's pipeline
    (pp.py); schedule-specific rules (Interleaved1F1B) are the trainer's (pp.py).
    """
    if pp > 1 and n_micro < pp:
        shown = f"{arithmetic} = {n_micro}" if arithmetic else str(n_micro)
        raise MeshError(
            f"micro-batches per rank >= pp fails: {shown} < mesh.pp={pp} (a pipeline schedule "
            f"needs at least pp micro-batches per step); change training.micro_batch (or "
            f"training.global_batch, mesh=...)"
        )


@dataclass(frozen=True)
class MeshDims:
    world: int
    pp: int = 1
    cp: int = 1
    ep: int = 1

    @property
    def dp(self) -> int:
        """Data-parallel degree, inferred: world / (pp * cp). Never a config field."""
        return self.world // (self.pp * self.cp)

    @property
    def dp_cp(self) -> int:
        """Size of the data x context group that EP is folded into: world / pp."""
        return self.world // self.pp

    @property
    def edp(self) -> int:
        """What remains of data x context after EP: the experts' FSDP degree."""
        return self.dp_cp // self.ep

    # Batch layout. A step's global batch of `global_batch` sequences is split row-major into
    # micro-batches of `micro_batch` sequences: data-parallel rank r runs micro-batch m on rows
    # [(m*dp + r)*micro_batch, (m*dp + r + 1)*micro_batch), and under context parallel each cp
    # rank holds 1/cp of every sequence. Forced balance numbers tokens in the same order
    # (micro-batch-major over the dp x cp ranks), so a run with dp ranks routes like one process
    # with micro-batches of dp*micro_batch sequences.

    def microbatches(self, global_batch: int, micro_batch: int) -> int:
        """Micro-batches per rank and step: global_batch / (dp * micro_batch)."""
        return global_batch // (self.dp * micro_batch)

    def first_row(self, microbatch: int, dp_rank: int, micro_batch: int) -> int:
        """Row of the global batch where `dp_rank`'s micro-batch `microbatch` starts."""
        return (microbatch * self.dp + dp_rank) * micro_batch

    def tokens_per_microbatch(self, micro_batch: int, sequence_length: int) -> int:
        """Tokens of one micro-batch on one rank: micro_batch * sequence_length / cp."""
        return micro_batch * sequence_length // self.cp

    def token_offset(
        self, microbatch: int, dp_cp_rank: int, micro_batch: int, sequence_length: int
    ) -> int:
        """Global index of the first token of micro-batch `microbatch` on the dp x cp rank
        `dp_cp_rank` (= dp_rank*cp + cp_rank): (microbatch * dp_cp + dp_cp_rank) *
        tokens_per_microbatch, the index forced balance counts slots by."""
        tokens = self.tokens_per_microbatch(micro_batch, sequence_length)
        return (microbatch * self.dp_cp + dp_cp_rank) * tokens

    def check_layout(self) -> None:
        for name, value in (("mesh.pp", self.pp), ("mesh.cp", self.cp), ("mesh.ep", self.ep)):
            if value < 1:
                raise MeshError(f"{name}={value} must be >= 1: change {name}")
        if self.world < 1:
            raise MeshError(
                f"world size {self.world} must be >= 1: change mesh.nnodes or mesh.nproc_per_node"
            )
        if self.world % self.pp:
            raise MeshError(
                f"world % pp == 0 fails: world {self.world} % mesh.pp={self.pp} = "
                f"{self.world % self.pp}; change mesh.pp or mesh.nproc_per_node"
            )
        for name, value in (("mesh.cp", self.cp), ("mesh.ep", self.ep)):
            if self.dp_cp % value:
                raise MeshError(
                    f"{name}={value} must divide world/pp = {self.world}/{self.pp} = "
                    f"{self.dp_cp}; change {name} (or mesh.pp, mesh.nproc_per_node)"
                )

    def check_sequence(self, sequence_length: int) -> None:
        if sequence_length % (2 * self.cp):
            raise MeshError(
                f"sequence_length % (2*cp) == 0 fails: {sequence_length} % (2*{self.cp}) = "
                f"{sequence_length % (2 * self.cp)}; change training.sequence_length or mesh.cp"
            )

    def check_batch(self, global_batch: int, micro_batch: int = 1) -> None:
        """The batch split the trainer needs: global_batch = dp * micro_batch * n_micro.

        Each rank gets global_batch/dp sequences (>= 2*pp), cut into n_micro micro-batches of
        micro_batch sequences; under pp > 1 a pipeline schedule needs n_micro >= pp.
        """
        dp = self.dp
        if global_batch % dp:
            raise MeshError(
                f"training.global_batch={global_batch} must be divisible by dp = world/(pp*cp) = "
                f"{self.world}/({self.pp}*{self.cp}) = {dp}; change training.global_batch "
                f"(or mesh=...)"
            )
        local = global_batch // dp
        if local < 2 * self.pp:
            raise MeshError(
                f"global_batch/dp >= 2*pp fails: {global_batch}/{dp} = {local} < 2*{self.pp}; "
                f"change training.global_batch (or mesh.pp)"
            )
        if micro_batch < 1:
            raise MeshError(
                f"training.micro_batch={micro_batch} must be >= 1; change training.micro_batch"
            )
        if local % micro_batch:
            raise MeshError(
                f"global_batch % (dp*micro_batch) == 0 fails: training.micro_batch={micro_batch} "
                f"must divide global_batch/dp = {global_batch}/{dp} = {local}; change "
                f"training.micro_batch (or training.global_batch, mesh=...)"
            )
        check_microbatches(
            self.microbatches(global_batch, micro_batch),
            self.pp,
            arithmetic=f"global_batch/(dp*micro_batch) = {global_batch}/({dp}*{micro_batch})",
        )

    def check_experts(self, num_experts: int) -> None:
        if num_experts % self.ep:
            raise MeshError(
                f"experts % ep == 0 fails: model.num_experts={num_experts} % mesh.ep={self.ep} "
                f"= {num_experts % self.ep}; change mesh.ep"
            )

    def validate(
        self, *, sequence_length: int, global_batch: int, micro_batch: int, num_experts: int
    ) -> None:
        """All mesh prerequisites, in the order a user would fix them."""
        self.check_layout()
        self.check_sequence(sequence_length)
        self.check_batch(global_batch, micro_batch)
        self.check_experts(num_experts)

    def tag(self, sequence_length: int, dtype: str) -> str:
        """`pp2-dp8-cp1-ep8-seq2048-bf16`: every dimension, defaults included."""
        return f"pp{self.pp}-dp{self.dp}-cp{self.cp}-ep{self.ep}-seq{sequence_length}-{dtype}"
