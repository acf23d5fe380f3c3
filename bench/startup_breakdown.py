"""Where one arm's wall time went, in one table, from what a single run of it leaves behind.

    python bench/startup_breakdown.py ARM_DIR [--json FILE] [--top 3]

ARM_DIR is an arm's directory: bench_startup.py's OUT/runN, or an arm of a sweep. It reads:
* metrics.json (the runner's record): the arm's wall, the trainer's wall from launch to exit,
  every step's time, the trainer's start-up marks (seconds since its process started) and
  dynamo's phase clocks of its compiles;
* OUT/startup.json when ARM_DIR is bench_startup.py's OUT/runN: the whole command's wall,
  whose rest is the runner's own start and exit;
* profile/stacks_rank0.txt when the arm ran with trainer.sample_stacks_ms (5 is enough): each
  timeline phase's main-thread seconds by category (CATEGORIES: the first whose pattern a
  frame of the stack holds), step 1 apart from the build's end before it, and what autograd's
  device thread did in step 1's backward while the main thread waited on it;
* console.log when the trainer ran with `-X importtime` (a one-process arm:
  trainer.command=[-X,importtime,-m,moe_perf.trainer]): the heaviest imports of the process,
  those before `main` and those done lazily later (which the stacks also count as imports);
* the arm's startup.json: what the start-up's helper threads took (trainer.warm_attention's
  warm-up, trainer.early_cuda_context's context) and how long the build waited for them.

So one warm arm run with `--set trainer.sample_stacks_ms=5 --set
'trainer.command=[-X,importtime,-m,moe_perf.trainer]'` attributes its seconds to imports, the
CUDA context, the model's build, compile-cache loads and dynamo's trace (dynamo's clocks split
the compile row), and step 1's first calls (cuDNN's attention, Triton). Sampling and import
timing cost the run a little: read its parts, and time the arm itself without them.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import stacks_summary  # noqa: E402  (bench/)

STEP = "moe_perf/trainer/train.py:train_step"
# (category, patterns): a stack goes to the first category one of whose patterns is in one of
# its frames' labels (trainer/stacks.py's `file:function`, an op as `__call__ aten.<op>`)
CATEGORIES = (
    # lazy imports first, wherever they happen (a module's own code runs inside its import)
    ("imports", ("<frozen importlib._bootstrap>:_find_and_load",)),
    # a compile: dynamo's frame conversion, or AOTAutograd compiling the backward at its first
    # run (outside dynamo); inside them, the cache loads and the waits on the compile workers
    ("compile: dynamo's trace, AOTAutograd, inductor, cache loads",
     ("torch/_dynamo/convert_frame.py:", "torch/_inductor/compile_fx.py:",
      "torch/_functorch/_aot_autograd/autograd_cache.py:")),
    ("Triton: kernel compiles and loads", ("triton/",)),
    ("attention (SDPA; in step 1 cuDNN's first calls)",
     ("scaled_dot_product", "moe_perf/trainer/attention.py:causal_attention")),
    ("CUDA context and device", ("torch/cuda/__init__.py:_lazy_init",
                                 "torch/cuda/__init__.py:set_device")),
    ("inductor's compile workers: their start, waits on them",
     ("torch/_inductor/async_compile.py:", "torch/_inductor/compile_worker/")),
    ("waiting on autograd's device thread (backward)",
     ("torch/autograd/graph.py:_engine_run_backward",)),
    ("thread joins", ("threading.py:join",)),
    ("model: build, initialisation, steps' Python", ("moe_perf/trainer/",)),
)  # fmt: skip
OTHER = "other"
PHASES = (
    "since main", "since process_group", "since model_on_meta", "parallelized -> step 1",
    "step 1", "step 1: autograd's device thread", "since step1_done", "since steps_done",
)  # fmt: skip
IMPORT_LINE = re.compile(r"import time:\s+(\d+) \|\s+(\d+) \| ( *)(\S+)")


# the start-up's helper threads startup.json may describe: its key, and the name shown
HELPERS = {"attention_warm_up": "attention warm-up", "early_cuda_context": "early CUDA context"}


def category(frames: list[str]) -> str:
    for name, patterns in CATEGORIES:
        if any(p in frame for frame in frames for p in patterns):
            return name
    return OTHER


# (part, from, to): the trainer process's spans between its marks (seconds since it started)
BUILD_SPANS = (
    ("trainer: interpreter and imports, to main", "start", "main"),
    ("main -> process_group: device, CUDA context, helpers", "main", "process_group"),
    ("process_group -> model_on_meta: model on meta", "process_group", "model_on_meta"),
    ("model_on_meta -> parallelized: materialise, init, wrap", "model_on_meta", "parallelized"),
    ("parallelized -> step 1: optimizer, helpers, joins", "parallelized", "step1_start"),
    ("step 1", "step1_start", "step1_done"),
)
END_SPANS = (("after the steps: profiles, process group's end", "steps_done", "finished"),)


def timeline(record: dict, command_s: float | None) -> list[tuple[str, float]]:
    """(part, seconds) of the arm in the order they happen; they add up to the command's wall
    (with `command_s`) or to the arm's."""
    times = [s["step_time_s"] for s in record["steps"]]
    marks = {"start": 0.0, **record["startup_marks_s"]}
    marks["step1_start"] = marks["step1_done"] - times[0]
    arm_s, trainer_s = record["wall_time_s"], record["trainer_wall_s"]
    rows = (
        [("runner: its start, compose, pre-flight, exit", command_s - arm_s)] if command_s else []
    )
    rows += [
        ("runner: the arm's worktree, config, record", arm_s - trainer_s),
        ("launch and exit, outside the trainer process", trainer_s - marks["finished"]),
    ]
    rows += [(part, marks[b] - marks[a]) for part, a, b in BUILD_SPANS]
    between = marks["steps_done"] - marks["step1_done"] - sum(times[1:])
    rows += [(f"measured steps ({len(times) - 1})", sum(times[1:])),
             ("between the steps: metrics, contract lines", between)]  # fmt: skip
    rows += [(part, marks[b] - marks[a]) for part, a, b in END_SPANS]
    return [(part, round(seconds, 3)) for part, seconds in rows]


def stack_parts(stacks: Path) -> dict[str, dict[str, float]]:
    """Per timeline phase (step 1 apart), the main thread's seconds by category; and, as
    "step 1: autograd's device thread", that thread's seconds in step 1 by category."""
    parts: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for phase, frames, seconds in stacks_summary.read(stacks, "main"):
        if phase == "since parallelized":
            phase = "step 1" if STEP in frames else "parallelized -> step 1"
        parts[phase][category(frames)] += seconds
    for phase, frames, seconds in stacks_summary.read(stacks, "unnamed thread"):
        if phase == "since parallelized":
            parts["step 1: autograd's device thread"][category(frames)] += seconds
    order = {phase: i for i, phase in enumerate(PHASES)}
    return {phase: dict(sorted(parts[phase].items(), key=lambda kv: -kv[1]))
            for phase in sorted(parts, key=lambda p: order.get(p, len(order)))}  # fmt: skip


def imports(console: str, top: int) -> list[dict]:
    """The process's top-level imports of at least 50 ms (-X importtime's cumulative times),
    heaviest first, each with its `top` heaviest direct imports."""
    roots: list[dict] = []
    for line in console.splitlines():
        found = IMPORT_LINE.match(line)
        if not found:
            continue
        _, cumulative_us, indent, name = found.groups()
        entry = {"module": name, "s": int(cumulative_us) / 1e6, "depth": len(indent) // 2}
        roots.append(entry)
    tree, children = [], []
    for entry in roots:  # a module's line comes after those of the modules it imported
        if entry["depth"] == 0:
            kids = sorted((c for c in children if c["depth"] == 1), key=lambda c: -c["s"])
            heaviest = [(c["module"], round(c["s"], 3)) for c in kids[:top]]
            tree.append(
                {"module": entry["module"], "s": round(entry["s"], 3), "heaviest": heaviest}
            )
            children = []
        else:
            children.append(entry)
    return sorted((t for t in tree if t["s"] >= 0.05), key=lambda t: -t["s"])


def command_wall(arm_dir: Path) -> float | None:
    """bench_startup.py's whole-command wall of OUT/runN, from OUT/startup.json."""
    found = re.fullmatch(r"run(\d+)", arm_dir.name)
    bench = arm_dir.parent / "startup.json"
    if not found or not bench.is_file():
        return None
    runs = json.loads(bench.read_text()).get("runs", [])
    i = int(found.group(1)) - 1
    return runs[i]["command_wall_s"] if i < len(runs) else None


def breakdown(arm_dir: Path, top: int = 3) -> dict:
    record = json.loads((arm_dir / "metrics.json").read_text())
    if record.get("status") != "ok" or not record.get("startup_marks_s"):
        raise SystemExit(f"startup_breakdown: {arm_dir} has no completed reference-trainer arm")
    result = {
        "arm_dir": str(arm_dir),
        "timeline_s": timeline(record, command_wall(arm_dir)),
        "compile_phases_s": (record.get("startup_compile") or {}).get("phases_s", {}),
    }
    stacks = arm_dir / "profile" / "stacks_rank0.txt"
    if stacks.is_file():
        result["stacks_s"] = stack_parts(stacks)
    console = arm_dir / "console.log"
    found = imports(console.read_text(errors="replace"), top) if console.is_file() else []
    if found:
        result["imports_s"] = found
    startup = arm_dir / "startup.json"
    info = json.loads(startup.read_text()) if startup.is_file() else {}
    for helper in HELPERS:
        if info.get(helper):
            result[helper] = info[helper]
    return result


def show(result: dict, out=sys.stdout) -> None:
    total = sum(s for _, s in result["timeline_s"])
    print(f"== {result['arm_dir']}: {total:.2f} s", file=out)
    for part, seconds in result["timeline_s"]:
        print(f"  {seconds:8.2f}  {part}", file=out)
    for phase, parts in result.get("stacks_s", {}).items():
        print(f"== sampled stacks, {phase}: {sum(parts.values()):.2f} s", file=out)
        for name, seconds in parts.items():
            print(f"  {seconds:8.2f}  {name}", file=out)
    if result["compile_phases_s"]:
        clocks = ", ".join(f"{k} {v:.2f}" for k, v in result["compile_phases_s"].items())
        print(f"== dynamo's compile clocks (s, nested): {clocks}", file=out)
    for entry in result.get("imports_s", []):
        heaviest = ", ".join(f"{m} {s:.2f}" for m, s in entry["heaviest"])
        print(f"  import {entry['module']}: {entry['s']:.2f} s ({heaviest})", file=out)
    for helper, name in HELPERS.items():
        if helper in result:
            print(f"== {name}: {json.dumps(result[helper])}", file=out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("arm_dir", type=Path)
    p.add_argument("--json", type=Path, help="also write the breakdown there")
    p.add_argument("--top", type=int, default=3, help="heaviest direct imports per import")
    args = p.parse_args(argv)
    result = breakdown(args.arm_dir.resolve(), args.top)
    show(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
