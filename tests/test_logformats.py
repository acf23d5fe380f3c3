"""Every log format and variant moe_perf reads, in the lines the frameworks really print (their
own format strings: torchtitan's metrics.py, Megatron-LM's training_log and report_memory,
Megatron-Bridge's memory report, NeMo 2.0's progress printer), and the compare CLI on them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from moe_perf.common.contract import format_step
from moe_perf.logs import (
    LogReader,
    RunShape,
    TeeLines,
    clean,
    detect_format,
    line_parser,
    parse_lines,
)
from moe_perf.report import cli

ESC = "\x1b"
# torchtitan's colours: red, green, orange (24-bit), turquoise (24-bit), blue, cyan, magenta
RED, GREEN, ORANGE = f"{ESC}[31m", f"{ESC}[32m", f"{ESC}[38;2;180;60;0m"
TURQUOISE, BLUE, CYAN, MAGENTA, RESET = (
    f"{ESC}[38;2;54;234;195m", f"{ESC}[34m", f"{ESC}[36m", f"{ESC}[35m", f"{ESC}[39m",
)  # fmt: skip


def titan(step: int, tps: int, *, second: float = 0.0, memory: float = 4.26,
          tflops: str = "39.59", mfu: str = "N/A", prefix: str = "[rank0]:") -> str:  # fmt: skip
    """A torchtitan 0.3 step line as its logger prints it (timestamp, colours)."""
    stamp = f"2026-07-17 12:05:{int(second):02d},{int(second % 1 * 1000):03d}"
    return (
        f"{prefix}[titan] {stamp} - root - INFO - {RED}step: {step:2}  {GREEN}loss:  6.09081  "
        f"{ORANGE}grad_norm:  4.2098  {TURQUOISE}memory: {memory:5.2f}GiB(2.39%)  "
        f"{BLUE}tps: {tps:,}  {CYAN}tflops: {tflops}  {MAGENTA}mfu: {mfu}{RESET}"
    )


def titan_2024(step: int, wps: int, second: float) -> str:
    """torchtitan of spring 2024: `wps:`, no grad_norm or tflops, no `[titan]` tag."""
    return (
        f"2024-04-10 10:50:{int(second):02d},{int(second % 1 * 1000):03d} - root - INFO - "
        f"{ESC}[36mstep: {step:2}  {ESC}[32mloss: 10.8423  {ESC}[33mmemory: 20.50GiB(25.91%)  "
        f"{ESC}[34mwps: {wps:,}  {ESC}[35mmfu: 31.20%{ESC}[39m"
    )


def titan_validate(step: int) -> str:
    return (
        f"[rank0]:[titan] 2026-07-17 12:06:00,000 - root - INFO - {ESC}[33mvalidate step: "
        f"{step:2}  {GREEN}loss:  7.1234  {TURQUOISE}memory: 30.00GiB(9.00%)  {BLUE}tps: 999{RESET}"
    )


def megatron(step: int, ms: float, *, skipped: int = 0, total: int = 100, gbs: int = 128) -> str:
    return (
        f" [2024-04-06 02:59:{step:02d}] iteration {step:8d}/{total:8d} | consumed samples: "
        f"{step * gbs:12d} | elapsed time per iteration (ms): {ms:.1f} | throughput per GPU "
        f"(TFLOP/s/GPU): 239.8 | learning rate: 8.600000E-06 | global batch size: {gbs:5d} | "
        f"lm loss: 1.825991E+00 | loss scale: 1.0 | grad norm: 0.456 | number of skipped "
        f"iterations: {skipped:3d} | number of nan iterations:   0 |"
    )


def megatron_memory(rank: int, max_reserved_mb: float) -> str:
    return (
        f"[Rank {rank}] (after 2 iterations) memory (MB) | allocated: 30000.50 | max allocated: "
        f"40000.00 | reserved: 45000.00 | max reserved: {max_reserved_mb:.2f}"
    )


def nemo(iteration: int, seconds: float, total: int = 29) -> str:
    return (
        f"Training epoch 0, iteration {iteration}/{total} | lr: 1.35e-06 | global_batch_size: 128 "
        f"| global_step: {iteration} | reduced_train_loss: 11.03 | train_step_timing in s: "
        f"{seconds} | consumed_samples: {(iteration + 1) * 128}"
    )


NEMO_MEMORY = (
    "[Rank 0] (after 2 iterations) memory (GB) | mem-allocated-gigabytes: 120.5 | "
    "mem-max-allocated-gigabytes: 190.2 | mem-max-reserved-gigabytes: 216.89"
)
SHAPE = RunShape(global_batch=32, seq_length=2048, world_size=8)


# ---- torchtitan ------------------------------------------------------------------------------


def test_titan_line_fields_with_colours_and_rank_prefix():
    (first, second) = parse_lines(
        [titan(1, 8000, mfu="38.12%"), titan(2, 8192, second=1)], "torchtitan", SHAPE
    ).steps
    assert second["peak_mem_gib"] == pytest.approx(4.26)
    assert second["loss"] == pytest.approx(6.09081)
    assert second["tflops"] == pytest.approx(39.59)
    assert first["mfu"] == pytest.approx(0.3812) and second["mfu"] is None  # N/A: unknown


def test_titan_tps_is_per_device_even_under_pp():
    # pp2 on 8 GPUs, global batch 32 x 2048: torchtitan divides its tps by cp x tp x pp, so each
    # device's share is 32*2048/8 = 8192 tokens per step; local batch x seq is pp times more
    parsed = parse_lines([titan(1, 4096), titan(2, 4096, second=2)], "torchtitan", SHAPE)
    step = parsed.steps[1]
    assert step["step_time_s"] == pytest.approx(32 * 2048 / 8 / 4096)  # 2.0 s
    assert step["tokens_per_s"] == pytest.approx(4096 * 8)  # global
    assert "tokens_per_s_device" not in step
    assert any("per device" in d for d in parsed.derivations)


def test_titan_without_shape_step_time_from_timestamps():
    lines = [titan(k, 8192, second=10 + 1.25 * k) for k in range(1, 6)]
    parsed = parse_lines(lines, "torchtitan")
    assert parsed.steps[0]["step_time_s"] is None  # no line before it
    assert [s["step_time_s"] for s in parsed.steps[1:]] == pytest.approx([1.25] * 4)
    assert all(s["tokens_per_s"] is None for s in parsed.steps)  # per device: never shown global
    assert parsed.steps[1]["tokens_per_s_device"] == 8192
    assert any("timestamps" in d for d in parsed.derivations)
    assert any("tokens_per_s unknown" in d for d in parsed.derivations)


def test_titan_ansi_codes_without_their_esc_byte():
    lines = [titan(k, 8192, second=k).replace(ESC, "") for k in range(1, 4)]
    assert "[31mstep:" in lines[0]
    parsed = parse_lines(lines)
    assert parsed.log_format == "torchtitan"
    assert [s["step"] for s in parsed.steps] == [1, 2, 3]
    assert parsed.steps[2]["peak_mem_gib"] == pytest.approx(4.26)
    # and the contract prefix is not mistaken for a colour code without ESC
    assert clean("[moe_perf] step=1/2")[1] == "[moe_perf] step=1/2"


def test_titan_2024_wps_lines():
    lines = [titan_2024(k, 5000, second=2.0 * k) for k in range(1, 4)]
    parsed = parse_lines(lines, "auto", RunShape(16, 2048, 4))
    assert parsed.log_format == "torchtitan"
    step = parsed.steps[1]
    assert step["step_time_s"] == pytest.approx(16 * 2048 / 4 / 5000)
    assert step["tokens_per_s"] == pytest.approx(5000 * 4)
    assert step["mfu"] == pytest.approx(0.312) and step["tflops"] is None
    assert step["peak_mem_gib"] == pytest.approx(20.5)


def test_titan_validate_step_never_overwrites_a_training_step():
    lines = [titan(1, 8000), titan(2, 8192, second=1), titan_validate(2), titan(3, 8192, second=2)]
    parsed = parse_lines(lines, "torchtitan", SHAPE)
    assert [s["step"] for s in parsed.steps] == [1, 2, 3]
    assert parsed.steps[1]["loss"] == pytest.approx(6.09081)  # not the validation loss
    assert parsed.steps[1]["peak_mem_gib"] == pytest.approx(4.26)  # nor its memory
    assert any("validate step" in d for d in parsed.derivations)


def test_titan_srun_task_prefix():
    lines = [f"{k % 2}: " + titan(k, 8192, second=k, prefix="") for k in range(1, 4)]
    parsed = parse_lines(lines, "auto", SHAPE)
    assert parsed.log_format == "torchtitan" and len(parsed.steps) == 3


def test_titan_every_rank_prints_its_own_line():
    # no rank prefix; each rank's own memory and throughput; loss only on the last PP stage
    lines = []
    for step in (1, 2, 3):
        lines.append(titan(step, 8192, second=step, memory=10.0, prefix=""))
        lines.append(titan(step, 4096, second=step, memory=30.0 + step, prefix="")
                     .replace("loss:  6.09081", "loss: -1.00000"))  # fmt: skip
    parsed = parse_lines(lines, "torchtitan", SHAPE)
    assert [s["step"] for s in parsed.steps] == [1, 2, 3]
    step = parsed.steps[1]
    assert step["peak_mem_gib"] == pytest.approx(32.0)  # max over ranks
    assert step["step_time_s"] == pytest.approx(8192 / 4096)  # the slowest rank's
    assert step["loss"] == pytest.approx(6.09081)  # a negative loss is no loss
    assert any("several ranks" in d for d in parsed.derivations)


def test_titan_line_torchrun_passed_on_in_two_pieces_is_one_line():
    # torchrun --tee's readline can return a rank's line half written: the first piece has no
    # newline, so the next rank's line is glued on; the rest comes later under the same prefix
    lines = []
    for step in (1, 2, 3):
        rank0 = titan(step, 8192, second=step, memory=10.0)
        rank1 = titan(step, 4096, second=2 * step, memory=30.0 + step, prefix="[rank1]:")
        if step == 2:
            cut = rank1.index("tps: 4,0") + len("tps: 4,")  # also cuts the number itself
            lines += [rank1[:cut] + rank0, "[rank1]:" + rank1[cut:]]
        else:
            lines += [rank0, rank1]
    parsed = parse_lines(lines, "torchtitan", SHAPE)
    assert parsed.failure(3) is None and parsed.problems == []
    assert [s["step"] for s in parsed.steps] == [1, 2, 3]
    step = parsed.steps[1]
    assert step["peak_mem_gib"] == pytest.approx(32.0)  # rank 1's, from its reassembled line
    assert step["step_time_s"] == pytest.approx(8192 / 4096)  # 4,096 whole, not "4,"


def test_titan_tps_against_its_own_clock_catches_a_shape_the_trainer_does_not_run():
    # the trainer ran global batch 16 where moe_perf was told 32: its 1 s steps print
    # 16*2048/8 = 4,096 tokens/s per device, which under the given shape reads as 2 s
    lines = [titan(step, 4096, second=10 + step) for step in (1, 2, 3)]
    told = parse_lines(lines, "torchtitan", SHAPE)
    assert "step 2: tps 4,096 per device means 2.000 s" in told.failure(3)
    assert "stamps say 1.000 s" in told.failure(3) and "training.global_batch" in told.failure(3)
    assert len(told.problems) == 1 and told.problems[0].endswith("(and 1 more such step)")  # step 3
    ran = parse_lines(lines, "torchtitan", RunShape(16, 2048, 8))
    assert ran.problems == [] and ran.steps[1]["step_time_s"] == pytest.approx(1.0)


def test_titan_clock_agrees_with_a_published_torchtitan_log():
    # stamps and tps of steps 22-29 of a torchtitan log published in pytorch/torchtitan#950
    # (one GPU, 8 x 2048 tokens a step, ~80 ms steps, a dataset warning between two of them):
    # tps x the time between stamps stays within 1.2% of 16,384 tokens
    stamps_tps = [("21,511", 193831), ("21,589", 212462), ("21,667", 209645),
                  ("21,751", 197367), ("21,848", 169197), ("21,929", 203673),
                  ("22,009", 205287), ("22,092", 196687)]  # fmt: skip
    lines = [
        f"[rank0]:[titan] 2025-03-12 11:10:{stamp} - root - INFO - step: {22 + k}  loss:  6.2  "
        f"memory:  1.41GiB(1.79%)  tps: {tps:,}  tflops: 18.36  mfu: 1.86%"
        for k, (stamp, tps) in enumerate(stamps_tps)
    ]
    lines.insert(2, "[rank0]:[titan] 2025-03-12 11:10:21,603 - root - WARNING - Dataset c4_test "
                    "is being re-looped")  # fmt: skip
    parsed = parse_lines(lines, "torchtitan", RunShape(8, 2048, 1))
    assert parsed.problems == [] and len(parsed.steps) == 8
    told_16 = parse_lines(lines, "torchtitan", RunShape(16, 2048, 1))  # twice its batch
    assert "step 23: tps 212,462 per device means 0.154 s" in told_16.failure(8)


def test_titan_clock_restarts_at_validation_and_spans_a_log_interval():
    # 1 s steps logged every 5 steps: 8,192 tokens/s per device over 5 steps' tokens is 5 s;
    # a 7 s validation after step 5, which the next rate leaves out (torchtitan restarts its
    # clock) and the stamps between the step lines do not
    validate = titan_validate(5).replace("12:06:00,000", "12:05:22,000")
    lines = [titan(5, 8192, second=15), validate, titan(10, 8192, second=27)]
    parsed = parse_lines(lines, "torchtitan", SHAPE)
    assert parsed.problems == []
    late = [titan(5, 8192, second=15), titan(10, 8192, second=27)]  # 12 s without validation
    assert "stamps say 12.000 s" in parse_lines(late, "torchtitan", SHAPE).failure(2)


def test_tee_lines_keeps_a_ranks_text_that_starts_with_a_prefix():
    tee = TeeLines()
    # torch's C++ warnings print their own `[rank0]:` (an empty piece is never a cut)
    assert tee.split("[rank0]:[rank0]:[W1204 ProcessGroupNCCL.cpp] x\n") == [
        "[rank0]:[rank0]:[W1204 ProcessGroupNCCL.cpp] x"
    ]
    assert tee.split("plain words\n") == ["plain words"]
    # srun --label stays in front; a piece a killed rank never ended comes back at the end
    assert tee.split("3: [rank1]:half[rank0]:whole\n") == ["3: [rank0]:whole"]
    assert tee.split("3: [rank1]: and the rest\n") == ["3: [rank1]:half and the rest"]
    assert tee.split("[rank2]:cut off[rank0]:last\n") == ["[rank0]:last"]
    assert tee.rest() == ["[rank2]:cut off"]


def test_titan_two_nodes_under_srun_label_with_local_rank_prefixes():
    # a log of another launch: torchrun's default prefix is the local rank, the same on each
    # node; srun --label's task number tells the nodes apart
    lines = [f"{node}: " + titan(step, 8192 - 1000 * node, second=step, memory=10.0 + node,
                                 prefix="[default0]:")
             for step in (1, 2, 3) for node in (0, 1)]  # fmt: skip
    parsed = parse_lines(lines, "torchtitan", RunShape(8, 2048, 2))
    assert parsed.problems == [] and [s["step"] for s in parsed.steps] == [1, 2, 3]
    assert parsed.steps[1]["peak_mem_gib"] == pytest.approx(11.0)  # node 1's
    assert parsed.steps[1]["step_time_s"] == pytest.approx(8192 / 7192)  # the slower node's


def test_titan_zero_tflops_is_unknown_and_log_interval_is_flagged():
    lines = [titan(1, 8192, tflops="0.00"), titan(10, 8192, second=9, tflops="0.00"),
             titan(20, 8192, second=19, tflops="0.00")]  # fmt: skip
    parsed = parse_lines(lines, "torchtitan")
    assert all(s["tflops"] is None for s in parsed.steps)
    assert [s.get("interval_steps") for s in parsed.steps] == [None, 9, 10]
    assert [s["step_time_s"] for s in parsed.steps[1:]] == pytest.approx([1.0, 1.0])
    assert any("averaged over log intervals" in d for d in parsed.derivations)


# ---- Megatron-LM -----------------------------------------------------------------------------


def test_megatron_lines_memory_over_ranks_and_tokens_from_the_shape():
    lines = [megatron(1, 9000.0), megatron_memory(0, 46080.0), megatron_memory(4, 51200.0),
             megatron(2, 5444.9), megatron(3, 5400.0)]  # fmt: skip
    parsed = parse_lines(lines, "auto", RunShape(seq_length=4096))
    assert parsed.log_format == "megatron"
    step = parsed.steps[1]
    assert step["step_time_s"] == pytest.approx(5.4449)
    assert step["tflops"] == pytest.approx(239.8) and step["loss"] == pytest.approx(1.825991)
    assert step["tokens_per_s"] == pytest.approx(128 * 4096 / 5.4449)
    assert step["peak_mem_gib"] == pytest.approx(50.0)  # 51200 MiB, the larger rank's
    assert step["max_steps"] == 100


def test_megatron_skipped_iterations_are_flagged_and_not_counted():
    lines = [megatron(1, 9000.0), megatron(2, 5000.0), megatron(3, 1200.0, skipped=1),
             megatron(4, 5000.0)]  # fmt: skip
    parsed = parse_lines(lines, "megatron", RunShape(seq_length=4096))
    assert [s["step"] for s in parsed.steps] == [1, 2, 4]
    assert parsed.skipped_steps == [3] and parsed.steps_reported == 4
    assert any("skipped iterations" in d and "3" in d for d in parsed.derivations)


def h200_megatron(stamp: str, step: int, ms: float, tflops: float) -> str:
    """A line as Megatron-LM d98e8a6 printed it on an H200 (qwen3-30b-a3b, 2 layers)."""
    return (
        f"[default0]: [2026-12-04 19:05:{stamp}] iteration {step:8d}/      10 | consumed "
        f"samples: {8 * step:12d} | elapsed time per iteration (ms): {ms:.1f} | throughput per "
        f"GPU (TFLOP/s/GPU): {tflops:.1f} | learning rate: 2.700000E-04 | global batch size:     8 "
        f"| lm loss: 1.234171E+01 | loss scale: 1.0 | grad norm: 2.171 | number of skipped "
        f"iterations:   0 | number of nan iterations:   0 |"
    )


def test_megatron_step_2_printed_as_the_mean_with_step_1_gets_its_own_time_back():
    """Megatron-LM d98e8a6 does not reset its interval timer after iteration 1's line: step 2
    printed 2226.1 ms, the mean of 3537.9 ms and its own 914 ms (the lines' timestamps)."""
    lines = [h200_megatron("28.634069", 1, 3537.9, 12.3),
             h200_megatron("29.548264", 2, 2226.1, 19.5),
             h200_megatron("30.346706", 3, 798.4, 54.3)]  # fmt: skip
    parsed = parse_lines(lines, "megatron", RunShape(8, 2048, 1))
    step1, step2, step3 = parsed.steps
    assert step2["step_time_s"] == pytest.approx(2 * 2.2261 - 3.5379)  # 0.9143 s
    assert step2["step_time_s"] == pytest.approx(29.548264 - 28.634069, rel=1e-3)
    assert step2["tokens_per_s"] == pytest.approx(8 * 2048 / step2["step_time_s"])
    assert step2["tflops"] == pytest.approx(19.5 * 2.2261 / step2["step_time_s"])
    assert (step1["step_time_s"], step3["step_time_s"]) == (3.5379, 0.7984)  # as printed
    assert any("mean over iterations 1-2" in d for d in parsed.derivations)
    # a Megatron that resets its timer prints the timestamps' time: left as printed
    reset = parse_lines([lines[0], h200_megatron("29.548264", 2, 914.2, 47.5)], "megatron")
    assert reset.steps[1]["step_time_s"] == pytest.approx(0.9142)
    assert not any("mean over" in d for d in reset.derivations)


def test_megatron_step_2_near_step_1_is_left_as_printed_whatever_the_timestamps_jitter():
    """Steps 1 and 2 of 60.0 and 60.2 ms whose lines are 62 ms apart by their millisecond
    timestamps: 60.2 is within 2% of the mean with step 1 and 3% off the timestamps, a jitter,
    not an average to undo (a newcomer's run of the e2e format test read 12.3 TFLOP/s for 12.5)."""
    lines = [h200_megatron("28.000000", 1, 60.0, 12.5), h200_megatron("28.062000", 2, 60.2, 12.5)]
    parsed = parse_lines(lines, "megatron", RunShape(8, 2048, 1))
    assert parsed.steps[1]["step_time_s"] == pytest.approx(0.0602)
    assert parsed.steps[1]["tflops"] == pytest.approx(12.5)
    assert not any("mean over" in d for d in parsed.derivations)


def test_megatron_bridge_memory_in_decimal_gigabytes():
    parsed = parse_lines([megatron(1, 900.0), NEMO_MEMORY, megatron(2, 800.0)], "megatron")
    assert parsed.steps[1]["peak_mem_gib"] == pytest.approx(216.89e9 / 2**30)


# ---- NeMo 2.0 / Megatron-Bridge --------------------------------------------------------------


def test_nemo_lines_are_not_megatron_lines():
    lines = [nemo(k, 26.93 + k / 100) for k in range(0, 4)] + [NEMO_MEMORY]
    assert line_parser("megatron")(clean(lines[1])[1]) is None
    assert detect_format(lines) == "nemo"
    parsed = parse_lines(lines, "auto", RunShape(seq_length=4096))
    assert [s["step"] for s in parsed.steps] == [1, 2, 3, 4]  # global_step counts from 0
    step = parsed.steps[1]
    assert step["step_time_s"] == pytest.approx(26.94)
    assert step["tokens_per_s"] == pytest.approx(128 * 4096 / 26.94)
    assert step["loss"] == pytest.approx(11.03)
    assert step["peak_mem_gib"] == pytest.approx(216.89e9 / 2**30)  # GB, not GiB
    # a Megatron reading of these lines finds no step at all, and says so
    assert parse_lines(lines, "megatron").failure(4).startswith("no metrics")


# ---- a user's regex, the contract, detection -------------------------------------------------


def test_regex_format_with_units_and_derived_tokens():
    spec = (r"it (?P<step>\d+) took (?P<step_time_ms>[\d.]+) ms mem (?P<memory>[\d.]+) "
            r"(?P<memory_unit>MiB|GB) loss (?P<loss>[\d.]+)")  # fmt: skip
    lines = ["it 1 took 900 ms mem 2048 MiB loss 3.5", "it 2 took 500 ms mem 4 GB loss 3.4"]
    parsed = parse_lines(lines, spec, RunShape(8, 512, 2))
    assert parsed.steps[0]["peak_mem_gib"] == pytest.approx(2.0)
    assert parsed.steps[1]["peak_mem_gib"] == pytest.approx(4e9 / 2**30)
    assert parsed.steps[1]["step_time_s"] == pytest.approx(0.5)
    assert parsed.steps[1]["tokens_per_s"] == pytest.approx(8 * 512 / 0.5)
    with pytest.raises(ValueError, match="needs"):
        line_parser(r"step (?P<step>\d+)")
    with pytest.raises(ValueError, match="unknown group"):
        line_parser(r"(?P<step>\d+) (?P<tps>\d+)")
    with pytest.raises(ValueError, match="not a regular expression"):
        line_parser(r"(?P<step>\d+")


def test_non_finite_and_negative_values_are_never_results():
    spec = r"step (?P<step>\d+) t=(?P<step_time_s>\S+) tok=(?P<tokens_per_s>\S+)"
    parsed = parse_lines(["step 1 t=nan tok=-5", "step 2 t=inf tok=100"], spec)
    assert all(s["step_time_s"] is None for s in parsed.steps)
    assert parsed.steps[0]["tokens_per_s"] is None and parsed.steps[1]["tokens_per_s"] == 100
    assert parsed.failure(2) == (
        "bad step lines, so no figure of this run is used: step 1: step_time_s=nan is not a "
        "positive number; step 1: tokens_per_s=-5 is not a positive number (and 1 more)"
    )


def test_contract_reads_rank_zero_and_fails_a_changed_repeat():
    def line(step, t):
        return format_step(step, 3, step_time_s=t, tokens_per_s=1 / t, peak_mem_gib=1.0)

    reader = LogReader("contract")
    assert reader.feed("[rank0]:" + line(1, 0.5))["step"] == 1
    assert reader.feed("[rank1]:" + line(1, 9.0)) is None  # other ranks: console.log only
    reader.feed("[rank0]:" + line(2, 0.4))
    reader.feed("[rank0]:" + line(2, 0.4))  # the same line again: dropped with a note
    parsed = reader.result()
    assert [s["step_time_s"] for s in parsed.steps] == [0.5, 0.4]
    assert parsed.derivations == ["step line(s) printed twice, the repeat dropped: step(s) 2"]
    assert parsed.failure(3) == "only 2 of 3 steps reported"
    reader.feed("[rank0]:" + line(2, 0.3))  # other values: which one is right is unknown
    assert "step 2 printed twice with different values" in reader.result().failure(3)


def test_detection_of_each_format():
    assert detect_format([titan(1, 8192)]) == "torchtitan"
    assert detect_format([megatron(1, 1.0)]) == "megatron"
    assert detect_format([nemo(0, 1.0)]) == "nemo"
    assert detect_format(["[rank0]:" + format_step(1, 2, step_time_s=1, tokens_per_s=1,
                                                   peak_mem_gib=1)]) == "contract"  # fmt: skip
    assert detect_format(["hello", "world"]) is None


# ---- the compare CLI -------------------------------------------------------------------------


def write(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moe_perf.compare", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def titan_log(path: Path, seconds_per_step: float) -> Path:
    return write(path, [titan(k, 8192, second=1 + seconds_per_step * k) for k in range(1, 9)])


@pytest.mark.slow
def test_cli_titan_logs_without_hints_use_timestamps_and_say_so(tmp_path):
    base = titan_log(tmp_path / "base.log", 0.5)
    feat = titan_log(tmp_path / "feat.log", 0.55)
    result = run_cli(str(base), str(feat))
    assert result.returncode == 0, result.stderr
    assert "(torchtitan)" in result.stdout and "timestamps" in result.stdout
    assert "+10.00% (slower)" in result.stdout


@pytest.mark.slow
def test_cli_titan_logs_with_the_shape(tmp_path):
    base = write(tmp_path / "base.log", [titan(k, 8000, second=k) for k in range(1, 9)])
    feat = write(tmp_path / "feat.log", [titan(k, 7200, second=k) for k in range(1, 9)])
    shape = ["--global-batch", "32", "--seq-length", "2048", "--world-size", "8"]
    result = run_cli(str(base), str(feat), *shape)
    assert result.returncode == 0, result.stderr
    # 8000 -> 7200 tokens/s per device: step time +11.11%, (global) tokens/s -10%
    assert "| +11.11% (slower) | -10.00% (slower) |" in result.stdout


@pytest.mark.slow
def test_cli_megatron_logs(tmp_path):
    def log(ms: float) -> list[str]:
        return [megatron(1, 9000.0), megatron_memory(0, 46080.0)] + [
            megatron(k, ms) for k in range(2, 9)
        ]

    base = write(tmp_path / "base.log", log(5000.0))
    feat = write(tmp_path / "feat.log", log(5250.0))
    result = run_cli(str(base), str(feat), "--seq-length", "4096")
    assert result.returncode == 0, result.stderr
    assert "(megatron)" in result.stdout
    assert "| +5.00% (slower) | -4.76% (slower) | +0.00% (same) |" in result.stdout


@pytest.mark.slow
def test_cli_refuses_logs_of_two_formats(tmp_path):
    base = titan_log(tmp_path / "base.log", 0.5)
    feat = write(tmp_path / "feat.log", [megatron(k, 500.0) for k in range(1, 9)])
    result = run_cli(str(base), str(feat))
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "torchtitan" in lines[0] and "megatron" in lines[0]
    assert result.stdout == ""


# a user's trainer that prints its own lines
OWN_REGEX = r"iter (?P<step>\d+) took (?P<step_time_ms>[0-9.]+) ms"


def own_lines(ms: float) -> list[str]:
    return [f"iter {k} took {ms + k % 2:.1f} ms" for k in range(1, 9)]


def test_cli_a_log_of_no_known_format_says_so_and_how_to_give_one(tmp_path, capsys):
    base = write(tmp_path / "base.log", own_lines(400.0))
    feat = write(tmp_path / "feat.log", own_lines(420.0))
    assert cli.main([str(base), str(feat)]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert f"{base}: no step line of a format moe_perf knows (tried: contract" in line
    assert all(name in line for name in ("torchtitan", "megatron", "nemo"))
    assert "give the format with --format '<regex with named groups>'" in line
    assert captured.out == ""
    # the regex it names reads them
    assert cli.main([str(base), str(feat), "--format", OWN_REGEX]) == 0
    assert "+5.00% (slower)" in capsys.readouterr().out


def test_a_regex_with_a_step_time_needs_only_the_batch_and_sequence_length():
    unknown = parse_lines(own_lines(400.0), OWN_REGEX, RunShape())
    (note,) = [d for d in unknown.derivations if d.startswith("tokens_per_s unknown")]
    assert "give the global batch and sequence length" in note and "world" not in note
    known = parse_lines(own_lines(400.0), OWN_REGEX, RunShape(global_batch=32, seq_length=2048))
    assert known.steps[1]["tokens_per_s"] == pytest.approx(65536 / 0.4)
    # a per-device figure does need the world size to be made global
    titan_lines = [titan(k, 8192, second=k) for k in range(1, 9)]
    per_device = parse_lines(titan_lines, "torchtitan", RunShape(global_batch=32, seq_length=2048))
    (note,) = [d for d in per_device.derivations if d.startswith("tokens_per_s unknown")]
    assert "world size" in note
