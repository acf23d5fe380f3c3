"""The tiny model under expert and data parallel gives the loss and gradients of one process.

For each mesh (dp, ep) on `dp` gloo processes, helpers/mesh_equivalence.py builds the tiny
model as the trainer does (meta device, `init_parallel`, train.py's `distribute`: EP slices
experts and swaps dispatchers, the rank's part is materialized from the seed, FSDP2 shards) and
a single-process reference from the same seed, and trains both 3 steps through train.py's own
step on the same global batches (train.py's data layout), with gradient accumulation over
micro-batches and plain SGD at a fixed lr. Checked, fp32 (rtol 1e-5, atol 1e-6):
  * the initial parameters, gathered (FSDP shards, then EP shards): exactly the reference's;
  * step-1 gradients: every parameter, gathered, against the reference's gradient;
  * the global gradient norm (parallelize.clip_grad_norm_ over FSDP and EP shards) against
    torch's on the reference, with clipping active (MAX_GRAD_NORM is below the tiny model's
    gradient norm);
  * losses of steps 1-3 (after two clipped SGD updates the models must still agree) and the
    final parameters.
pp and cp meshes go through the same harness in test_pp.py and test_cp.py.
"""

from __future__ import annotations

import pytest
from helpers.distributed import run_distributed
from helpers.mesh_equivalence import check_meshes

STEPS = 3
MAX_GRAD_NORM = 0.5  # below the tiny model's gradient norm: clipping is active
CLIPPED = {"steps": STEPS, "max_grad_norm": MAX_GRAD_NORM}
FORCED = {"benchmark": True, "load_balance": "global-batch", **CLIPPED}
REAL = {"benchmark": False, **CLIPPED}


@pytest.mark.slow
@pytest.mark.parametrize(
    "world,cases",
    [
        # One process under torchrun (mesh=single): FSDP over one rank.
        (1, [dict(ep=1, micro_batch=2, **FORCED)]),
        (
            2,
            [
                dict(ep=1, micro_batch=2, **FORCED),
                dict(ep=2, micro_batch=2, **FORCED),
                # Real routing (top-k of the router) and the sequence balance loss.
                dict(ep=2, micro_batch=4, load_balance="sequence", **REAL),
            ],
        ),
        (
            4,
            [
                dict(ep=2, micro_batch=1, **FORCED),
                dict(ep=4, micro_batch=1, **FORCED),
                dict(ep=4, micro_batch=2, load_balance="global-batch", **REAL),
            ],
        ),
    ],
    ids=["dp1-ep1", "dp2-ep1,2", "dp4-ep2,4"],
)
def test_tiny_model_matches_single_process(world, cases):
    run_distributed(check_meshes, world, cases)
