"""End to end, each log format through `trainer=command`: the real `python -m moe_perf ... -m
arm=base,feat` under torchrun, in a temporary git repository whose stand-in trainer prints its
steps as torchtitan, Megatron-LM, NeMo 2.0 or a user's own format does; its feature branch is
slower per step. The runner must read each format during the sweep, normalize and record it."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers.command import moe_perf, sweep_dir
from helpers.repos import commit, git, make_repo

from moe_perf.launchers.base import free_port
from moe_perf.launchers.process import trainer_env
from moe_perf.logs import RunShape, parse_lines

pytestmark = pytest.mark.slow
TAG = "pp1-dp1-cp1-ep1-seq64-fp32"

# Prints one step line per optimizer step in the format named by argv[1], with the line formats
# of the frameworks' own logging code. No torch: the launch itself is what is under test.
STAND_IN = textwrap.dedent(
    '''
    """A stand-in trainer: sleeps SLEEP_S per step and prints it in a framework's format."""
    import datetime
    import os
    import sys
    import time

    SLEEP_S = 0.02
    fmt, steps, gbs, seq = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    fmt = fmt if fmt in ("torchtitan", "megatron", "nemo") else "mine"  # else: a user's regex
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if rank == 0:  # what the runner put in the environment, for the tests to read
        with open(os.path.join(os.environ["MOE_PERF_ARM_DIR"], "env.txt"), "w") as f:
            for key in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR", "PYTHONPYCACHEPREFIX"):
                f.write(f"{key}={os.environ.get(key, '')}\\n")
    ESC = "\\x1b"

    def stamp(sep=","):
        now = datetime.datetime.now()
        return now.strftime("%Y-%m-%d %H:%M:%S") + sep + f"{now.microsecond // 1000:03d}"

    def pause_mid_line(line):
        """Rank 1 writes half its line (cut inside the tps number) and waits while torchrun's
        tee copies the half, a print of its own to stdout, then rank 0's whole line; rank 0
        waits for that. What is left of the line is returned, to be printed."""
        half_out, rank0_out = (os.path.join(os.environ["MOE_PERF_ARM_DIR"], name)
                               for name in ("half-out", "rank0-out"))
        if rank == 0:
            wait_for(half_out)
            open(rank0_out, "w").close()  # once printed: the caller prints it right after
            return line
        cut = line.index("tps: ") + 6
        sys.stderr.write(line[:cut])
        sys.stderr.flush()
        time.sleep(1.0)  # torchrun's tail reads every 0.1 s: ample, even on a busy CI host
        print("rank 1: a print of its own while its log line is half written", flush=True)
        time.sleep(1.0)
        open(half_out, "w").close()
        wait_for(rank0_out)
        time.sleep(1.0)
        return line[cut:]

    def wait_for(path):
        deadline = time.monotonic() + 30
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.01)

    print(f"rank {rank} of {world} starting", flush=True)
    last = time.perf_counter()
    for step in range(1, steps + 1):
        time.sleep(SLEEP_S)
        now = time.perf_counter()
        seconds, last = now - last, now
        if fmt == "torchtitan":  # every rank prints; tps per device; colours; a validation line
            tps = gbs * seq / world / seconds
            line = (f"[titan] {stamp()} - root - INFO - {ESC}[31mstep: {step:2}  {ESC}[32mloss: "
                    f" 7.5000  {ESC}[38;2;180;60;0mgrad_norm:  1.0000  {ESC}[38;2;54;234;195m"
                    f"memory: {1.5 + rank:5.2f}GiB(1.00%)  {ESC}[34mtps: {round(tps):,}  "
                    f"{ESC}[36mtflops: 0.00  {ESC}[35mmfu: N/A{ESC}[39m")
            if os.environ.get("PAUSE_MID_LINE") and step == 2:
                line = pause_mid_line(line)  # the pause is in the next step, as the stamps say
            print(line, file=sys.stderr, flush=True)  # torchtitan logs to stderr
            if step == 2:
                print(f"[titan] {stamp()} - root - INFO - {ESC}[33mvalidate step: {step:2}  "
                      f"{ESC}[32mloss:  9.0000  {ESC}[34mtps: 1{ESC}[39m", file=sys.stderr,
                      flush=True)
                last = time.perf_counter()  # torchtitan's validation restarts its clock
        elif fmt == "megatron" and rank == world - 1:  # the last pipeline rank prints
            skipped = 1 if step == 3 else 0
            print(f" [{stamp('.')}] iteration {step:8d}/{steps:8d} | consumed samples: "
                  f"{step * gbs:12d} | elapsed time per iteration (ms): {seconds * 1000:.1f} | "
                  f"throughput per GPU (TFLOP/s/GPU): 12.5 | learning rate: 3.000000E-04 | "
                  f"global batch size: {gbs:5d} | lm loss: 7.500000E+00 | loss scale: 1.0 | "
                  f"number of skipped iterations: {skipped:3d} | number of nan iterations:   0 |",
                  flush=True)
            if step == 2:
                print("[Rank 0] (after 2 iterations) memory (MB) | allocated: 100.00 | max "
                      "allocated: 200.00 | reserved: 300.00 | max reserved: 2048.00", flush=True)
        elif fmt == "nemo" and rank == 0:
            print(f"Training epoch 0, iteration {step - 1}/{steps - 1} | lr: 0.0003 | "
                  f"global_batch_size: {gbs} | global_step: {step - 1} | reduced_train_loss: 7.5"
                  f" | train_step_timing in s: {seconds:.4} | consumed_samples: {step * gbs}",
                  flush=True)
            if step == 2:
                print("[Rank 0] (after 2 iterations) memory (GB) | mem-allocated-gigabytes: 1.0 "
                      "| mem-max-reserved-gigabytes: 3.5", flush=True)
        elif fmt == "mine" and rank == 0:
            print(f"iter {step} took {seconds * 1000:.2f} ms, peak {512 * step} MB", flush=True)
    print(f"rank {rank} done", flush=True)
    '''
)
# A user's own format; no backslashes, so it passes through a Hydra override as it is.
MINE = (
    "iter (?P<step>[0-9]+) took (?P<step_time_ms>[0-9.]+) ms, peak (?P<memory>[0-9]+) "
    "(?P<memory_unit>MB)"
)


def stand_in_repo(path: Path) -> Path:
    """`main` with the stand-in; `feature` (checked out) sleeps 0.06 s more per step."""
    make_repo(path, {"fake/train.py": STAND_IN, ".gitignore": "__pycache__/\n"})
    git(path, "checkout", "-q", "-b", "feature")
    commit(path, {"fake/train.py": STAND_IN.replace("SLEEP_S = 0.02", "SLEEP_S = 0.08")}, "slow")
    return path


def sweep(repo: Path, log_format: str, *overrides: str, env: dict | None = None):
    # braces are Hydra's dict syntax: a placeholder goes in quotes
    command = ("trainer.command=[fake/train.py,'{trainer.log_format}','{training.max_steps}',"
               "'{training.global_batch}','{training.sequence_length}']")  # fmt: skip
    return moe_perf(
        repo, "trainer=command", command,
        f"trainer.log_format='{log_format}'", "training.sequence_length=64",
        "training.global_batch=4", "training.max_steps=6", "wandb.mode=disabled",
        "compare.max_pairs=1",
        "timeout_s=120", *overrides, "-m", "arm=base,feat", env=env,
    )  # fmt: skip


def records(repo: Path, tag: str = TAG) -> dict[str, dict]:
    arms = sweep_dir(repo) / "tiny"
    return {
        a: json.loads((arms / f"{tag}-{a}" / "metrics.json").read_text()) for a in ("base", "feat")
    }


def assert_feat_slower(repo: Path, result) -> dict:
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    (group,) = json.loads((sweep_dir(repo) / "comparison.json").read_text())["groups"]
    assert group["status"] == "compared", group
    assert group["difference"]["step_time_s"]["words"] == "slower"
    assert group["difference"]["tokens_per_s"]["words"] == "slower"
    return group


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return stand_in_repo(tmp_path_factory.mktemp("formats") / "repo")


def test_torchtitan_every_rank_per_device_tps(repo):
    result = sweep(repo, "torchtitan", "mesh=ep2")
    assert_feat_slower(repo, result)
    tag = "pp1-dp2-cp1-ep2-seq64-fp32"
    for arm, rec in records(repo, tag).items():
        assert rec["status"] == "ok" and rec["log_format"] == "torchtitan"
        assert [s["step"] for s in rec["steps"]] == [1, 2, 3, 4, 5, 6]  # validate line ignored
        step = rec["steps"][2]
        assert step["peak_mem_gib"] == pytest.approx(2.5)  # rank 1's, the larger
        assert step["tflops"] is None  # `tflops: 0.00` is unknown
        # per-device tps brought to global: 4 x 64 tokens per step over the step time
        assert step["tokens_per_s"] == pytest.approx(4 * 64 / step["step_time_s"], rel=1e-6)
        assert any("per device" in d for d in rec["derivations"])
        assert any("validate step" in d for d in rec["derivations"])
        assert f"[{arm}] step 3/6" in result.stdout
    assert records(repo, tag)["feat"]["summary"]["step_time_s"] > 0.06


def test_torchtitan_line_torchrun_passes_on_in_two_pieces(repo):
    # rank 1 writes half its step 2 line and pauses: torchrun's tee prints that half without a
    # newline, rank 0's line glued on, and the rest later under rank 1's prefix; rank 1's print
    # to stdout meanwhile comes under the same prefix, but in torchrun's other stream
    result = sweep(repo, "torchtitan", "mesh=ep2", env={"PAUSE_MID_LINE": "1"})
    assert_feat_slower(repo, result)
    tag = "pp1-dp2-cp1-ep2-seq64-fp32"
    for arm, rec in records(repo, tag).items():
        assert rec["status"] == "ok" and [s["step"] for s in rec["steps"]] == [1, 2, 3, 4, 5, 6]
        step = rec["steps"][1]
        assert step["peak_mem_gib"] == pytest.approx(2.5)  # rank 1's, from its whole line
        assert step["step_time_s"] < 0.5  # from rank 1's whole tps, not its first digit
        console = (sweep_dir(repo) / "tiny" / f"{tag}-{arm}" / "console.log").read_text()
        assert re.search(r"\[rank1\]:[^\n]*tps: \d\[rank0\]:", console)  # as printed
        assert "[rank1]:rank 1: a print of its own" in console


def test_the_command_gets_the_repositorys_compile_caches_and_bytecode_directory(repo, tmp_path):
    """As the reference trainer's arms: torch.compile's caches in the compile-cache directory,
    Python's bytecode in the machine's (the runner's environment forbids it beside the
    sources); the user's trainer.env wins."""
    cache, xdg = tmp_path / "cache", tmp_path / "xdg"
    result = sweep(repo, "nemo", f"compile_cache={cache}", "+trainer.env.TRITON_CACHE_DIR=/mine",
                   env={"PYTHONDONTWRITEBYTECODE": "1", "XDG_CACHE_HOME": str(xdg)})  # fmt: skip
    assert_feat_slower(repo, result)
    for arm, rec in records(repo).items():
        env_txt = sweep_dir(repo) / "tiny" / f"{TAG}-{arm}" / "env.txt"
        seen = dict(line.split("=", 1) for line in env_txt.read_text().splitlines())
        assert seen == {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
                        "TRITON_CACHE_DIR": "/mine",
                        "PYTHONPYCACHEPREFIX": str(xdg / "moe_perf" / "pycache")}  # fmt: skip
        assert rec["compile_cache"]["dir"] == str(cache)


def test_torchtitan_command_that_runs_another_batch_fails_naming_the_override(repo):
    # the command ignores training.global_batch=16 and runs 1 sequence a step: its tps, read
    # against 16 x 64 tokens, would claim 16x the step time the stamps show
    command = ("trainer.command=[fake/train.py,'{trainer.log_format}','{training.max_steps}',"
               "'1','{training.sequence_length}']")  # fmt: skip
    result = moe_perf(
        repo, "trainer=command", command, "trainer.log_format=torchtitan",
        "training.sequence_length=64", "training.global_batch=16", "training.max_steps=4",
        "wandb.mode=disabled", "timeout_s=120", "compare.max_pairs=1", "-m", "arm=base,feat",
    )  # fmt: skip
    assert result.returncode == 3, result.stdout[-3000:] + result.stderr[-3000:]
    for arm in ("base", "feat"):
        rec = json.loads((sweep_dir(repo) / "tiny" / f"{TAG}-{arm}" / "metrics.json").read_text())
        assert rec["status"] == "failed"
        assert "but the log's own stamps say" in rec["failure"]
        assert "training.global_batch" in rec["failure"]
    assert "No difference computed" in result.stdout


def test_two_torchrun_nodes_print_global_ranks(repo, tmp_path):
    # what srun starts on two nodes, here on one host: a torchrun agent per node, one worker
    # each, both every-rank torchtitan loggers. By default both would prefix `[default0]:`,
    # and the two nodes' step lines would read as one rank printing each step twice.
    env = trainer_env(repo, tmp_path, "token")
    flags = (f"--nnodes 2 --nproc-per-node 1 --rdzv-backend static --master-addr localhost "
             f"--master-port {free_port()} --tee 3").split()  # fmt: skip
    stand_in = ["fake/train.py", "torchtitan", "4", "4", "64"]

    def agent(node: int) -> subprocess.Popen:
        argv = [sys.executable, "-m", "torch.distributed.run", *flags, "--node-rank", str(node),
                "--log-dir", str(tmp_path / str(node)), *stand_in]  # fmt: skip
        return subprocess.Popen(argv, cwd=repo, env=env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)  # fmt: skip

    agents = [agent(0), agent(1)]
    lines = [line for proc in agents for line in proc.communicate(timeout=120)[0].splitlines()]
    assert [proc.returncode for proc in agents] == [0, 0]
    assert any(line.startswith("[rank1]:[titan]") for line in lines)  # node 1's worker
    parsed = parse_lines(lines, "torchtitan", RunShape(4, 64, 2))
    assert parsed.problems == [] and [s["step"] for s in parsed.steps] == [1, 2, 3, 4]
    assert parsed.steps[1]["peak_mem_gib"] == pytest.approx(2.5)  # node 1's, the larger


def test_megatron_skipped_iteration_and_memory_report(repo):
    result = sweep(repo, "megatron")
    assert_feat_slower(repo, result)
    for rec in records(repo).values():
        assert rec["status"] == "ok" and rec["log_format"] == "megatron"
        assert [s["step"] for s in rec["steps"]] == [1, 2, 4, 5, 6]  # 3 was skipped
        assert rec["steps"][1]["peak_mem_gib"] == pytest.approx(2.0)
        assert rec["steps"][1]["tflops"] == pytest.approx(12.5)
        assert any("skipped" in d for d in rec["derivations"])


def test_nemo_lines(repo):
    result = sweep(repo, "nemo")
    assert_feat_slower(repo, result)
    for rec in records(repo).values():
        assert rec["status"] == "ok" and rec["log_format"] == "nemo"
        assert [s["step"] for s in rec["steps"]] == [1, 2, 3, 4, 5, 6]
        assert rec["steps"][3]["peak_mem_gib"] == pytest.approx(3.5e9 / 2**30)


def test_a_users_regex(repo):
    result = sweep(repo, MINE)
    assert_feat_slower(repo, result)
    for rec in records(repo).values():
        assert rec["status"] == "ok" and rec["log_format"] == MINE
        assert rec["steps"][3]["peak_mem_gib"] == pytest.approx(2048e6 / 2**30)
        assert rec["steps"][3]["tokens_per_s"] == pytest.approx(
            4 * 64 / rec["steps"][3]["step_time_s"]
        )


def test_unknown_placeholder_is_a_one_line_prerequisite_error(repo):
    result = moe_perf(repo, "trainer=command", "trainer.command=[fake/train.py,'{mesh.tp}']",
                      "wandb.mode=disabled", "-m", "arm=base,feat")  # fmt: skip
    assert result.returncode == 2
    assert "trainer.command: unknown placeholder {mesh.tp}: no key mesh.tp" in result.stderr
    assert "nothing was launched" in result.stderr
