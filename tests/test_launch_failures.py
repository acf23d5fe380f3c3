"""Why a launch failed, read from console output shaped like a real torchrun launch."""

from __future__ import annotations

from moe_perf.launchers.failures import describe, read_failure, worker_lines

# The end of a Megatron-LM arm that died on an H200 (2026-12-04), trimmed: torch.distributed
# prefixes the worker's traceback with `[rank0]: `, inside torchrun's `[default0]:`.
MEGATRON_TAIL = """\
[default0]:> building train, validation, and test datasets ...
[default0]:[rank0]: Traceback (most recent call last):
[default0]:[rank0]:   File "/tmp/wt/pretrain_gpt.py", line 536, in <module>
[default0]:[rank0]:     pretrain(
[default0]:[rank0]:     total_eval_points = args.train_iters // args.eval_interval + 1
[default0]:[rank0]:                         ~~~~~~~~~~~~~~~~~^^~~~~~~~~~~~~~~~~~~~
[default0]:[rank0]: TypeError: unsupported operand type(s) for //: 'int' and 'NoneType'
[default0]:[rank0]:[W1204 06:28:54.707497317 ProcessGroupNCCL.cpp:1575] Warning: WARNING: \
destroy_process_group() was not called before program exit
E1204 06:28:56.000000 623 torch/distributed/elastic/multiprocessing/api.py:986] failed \
(exitcode: 1) local_rank: 0 (pid: 651) of binary: /usr/bin/python3
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
pretrain_gpt.py FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-04_06:28:56
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : 1 (pid: 651)
  error_file: <N/A>
============================================================
"""


def test_a_workers_exception_under_torch_distributed_rank_prefix_is_the_reason():
    failure = read_failure(MEGATRON_TAIL)
    assert (failure.exit_code, failure.rank) == (1, 0)
    assert failure.reason == "TypeError: unsupported operand type(s) for //: 'int' and 'NoneType'"
    assert describe(1, failure) == (
        "trainer exited with code 1 (rank 0): "
        "TypeError: unsupported operand type(s) for //: 'int' and 'NoneType'"
    )


def test_worker_lines_drop_both_prefixes_and_keep_the_rest():
    lines = worker_lines(MEGATRON_TAIL)
    assert lines[0] == "> building train, validation, and test datasets ..."
    assert lines[1] == "Traceback (most recent call last):"
    assert lines[-1].startswith("[W1204 06:28:54")  # a glog line keeps its own prefix


def test_rank_prefix_without_torchrun_prefix():
    console = "[rank0]: ValueError: bad shape\n[rank0]:   more\n"
    assert read_failure(console).reason == "ValueError: bad shape"
