"""Run a function on N CPU processes joined in a gloo process group (for distributed tests).

`run_distributed(fn, world_size, *args)` spawns `world_size` processes, each calling
`fn(rank, world_size, *args)` after `init_process_group("gloo")`; an exception on any rank fails
the caller with that rank's traceback. `fn` must be importable (a module-level function).

The ranks are forked from a forkserver that imported torch once for the whole test session, so a
rank starts in well under a second instead of importing torch afresh (about 3 s of CPU each,
with up to four ranks on two cores). The server forks before any torch work has run in it (no
OpenMP pool, no gloo state), so a rank starts as clean as a spawned one.
"""

from __future__ import annotations

import multiprocessing
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world_size: int, port: int, fn, args) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
    )
    # Several ranks share two cores: one intra-op thread each avoids oversubscription.
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        fn(rank, world_size, *args)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # A clean finish leaves at once: about 1 run in 6 aborted at interpreter exit after
    # destroy_process_group() (SIGABRT) with all work done, which must not fail a passing test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# set before the server starts (at the first run_distributed); an unimportable module is skipped
multiprocessing.set_forkserver_preload(["torch", "torch.distributed", "moe_perf.trainer.train"])


def run_distributed(fn, world_size: int, *args) -> None:
    mp.start_processes(_worker, args=(world_size, free_port(), fn, args), nprocs=world_size,
                       join=True, start_method="forkserver")  # fmt: skip


EXPERT_WEIGHTS = ("w13", "w2")


def full_tensor(name: str, t: torch.Tensor, par) -> torch.Tensor:
    """A parallelized model's parameter or gradient `t` (named `name`) as the full tensor one
    process holds: FSDP shards gathered, EP slices of the expert weights concatenated."""
    t = t.full_tensor() if hasattr(t, "full_tensor") else t
    if name.split(".")[-1] in EXPERT_WEIGHTS and ".experts." in name and par.dims.ep > 1:
        parts = [torch.empty_like(t) for _ in range(par.dims.ep)]
        dist.all_gather(parts, t.contiguous(), group=par.group("ep"))
        t = torch.cat(parts)
    return t
