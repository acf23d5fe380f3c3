"""The stack sampler (trainer.sample_stacks_ms): real threads sampled while they run, the phase
of each sample, op names, and the trainer writing its stacks that bench/stacks_summary.py
reads back."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from moe_perf.trainer import stacks

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import stacks_summary  # noqa: E402
from helpers.trainer_run import run_trainer, write_config  # noqa: E402

HERE = "test_stacks.py"  # a file outside a package: its name alone


def spin_in_python(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        sum(range(1000))


def matmuls(seconds: float) -> None:
    a = torch.randn(256, 256)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        torch.ops.aten.mm.default(a, a)


def wait_for(event: threading.Event) -> None:
    event.wait()


def test_samples_go_to_the_running_function_thread_and_phase(tmp_path):
    marks: dict[str, float] = {"main": 0.0}
    released = threading.Event()
    helper = threading.Thread(target=wait_for, args=(released,), name="helper-x")
    helper.start()
    t0 = time.perf_counter()
    sampler = stacks.start(2, marks)
    spin_in_python(0.4)
    marks["parallelized"] = 1.0
    matmuls(0.4)
    sampler.stop()
    wall = time.perf_counter() - t0
    released.set()
    helper.join()
    out = tmp_path / "stacks_rank0.txt"
    sampler.write(out)

    main = stacks_summary.summarize(stacks_summary.read(out))
    assert set(main) == {"since main", "since parallelized"}
    first, second = main["since main"], main["since parallelized"]
    # the main thread's seconds are the sampled wall time, split between the two phases
    assert 0.5 * wall < first["seconds"] + second["seconds"] <= wall
    assert first["inclusive"][f"{HERE}:spin_in_python"] > 0.5 * first["seconds"]
    assert f"{HERE}:matmuls" not in first["inclusive"]
    assert second["inclusive"][f"{HERE}:matmuls"] > 0.5 * second["seconds"]
    assert second["inclusive"]["torch/_ops.py:__call__ aten.mm.default"] > 0
    assert f"{HERE}:spin_in_python" not in second["inclusive"]

    waiting = stacks_summary.summarize(stacks_summary.read(out, thread="helper-x"))
    assert waiting["since main"]["inclusive"][f"{HERE}:wait_for"] > 0.2
    threads = {line.split(";")[1] for line in out.read_text().splitlines()}
    assert "[main]" in threads and "[helper-x]" in threads
    assert "[moe_perf-stacks]" not in threads  # the sampler leaves itself out


def test_frame_labels_name_the_package_path_and_function():
    def frame_from(filename: str):
        namespace: dict = {}
        exec(compile("import sys\ndef f():\n    return sys._getframe()\n", filename, "exec"),
             namespace)  # fmt: skip
        return namespace["f"]()

    label = stacks.frame_label
    assert label(frame_from("/x/lib/python3.12/site-packages/torch/_ops.py")) == "torch/_ops.py:f"
    worktree = "/tmp/moe_perf-arm/feat/moe_perf/trainer/train.py"
    assert label(frame_from(worktree)) == "moe_perf/trainer/train.py:f"
    assert label(frame_from("/usr/lib/python3.12/threading.py")) == "threading.py:f"


def test_off_by_default():
    assert stacks.start(0, {}) is None


@pytest.mark.slow
def test_the_trainer_writes_its_stacks_and_the_summary_reads_them(tmp_path):
    cfg = write_config(tmp_path, training={"max_steps": 3}, trainer={"sample_stacks_ms": 2})
    proc, steps = run_trainer(["-m", "moe_perf.trainer", str(cfg)])
    assert proc.returncode == 0, proc.stderr
    assert [s["step"] for s in steps] == [1, 2, 3]
    out = tmp_path / "profile" / "stacks_rank0.txt"
    phases = stacks_summary.summarize(
        stacks_summary.read(out), "moe_perf/trainer/train.py:train_step"
    )
    assert "moe_perf/trainer/train.py:forward_backward" in phases["since parallelized"]["inclusive"]
    assert "moe_perf/trainer/train.py:forward_backward" in phases["since step1_done"]["inclusive"]
    summary = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "stacks_summary.py"), str(out),
         "--phase", "since step1_done", "--under", "moe_perf/trainer/train.py:train_step"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert summary.stdout.startswith("== since step1_done: ")
    assert "moe_perf/trainer/train.py:forward_backward" in summary.stdout
    assert "since main" not in summary.stdout
