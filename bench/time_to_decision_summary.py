"""The figures of one run of bench/gpu_time_to_decision.sh: a page and a JSON file.

    python bench/time_to_decision_summary.py WORK OUT

WORK is the script's work directory: meta.json (commit, card, software, command, the switch
under A/B), startup/ (bench_startup.py: the machine's first arm, then warm ones),
warmup/<variant><i>/ and cold/ (the switch off and on, one arm each), breakdown/run1 (one warm
arm with sampled stacks and import times), breakdown-cold/run1 (the same, compile caches empty),
trainer/<variant>-<i>/ (bench_trainer.py: bf16, fp8, fp8 over master weights),
preload/<off|on>-<i>/ (bench_startup.py --pairs 2: one sweep of four arms with launcher.preload
off or on), runner-bytecode/ (bench_runner_bytecode.py: the runner's own imports, its bytecode
kept or compiled anew), titan/bench.txt (torchtitan, when it ran) and skipped.txt (what did not
run, and why). Writes OUT/summary.md, OUT/figures.json, OUT/breakdown.txt and
OUT/breakdown-cold.txt; parts that did not run are left out and skipped.txt says why. It
reports medians, ranges and differences; it decides nothing (a switch's default changes on the
project's verdict, not here).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import startup_breakdown  # noqa: E402  (bench/)

from moe_perf.common import contract  # noqa: E402

WARM_ARM_GOAL_S, FIRST_ARM_GOAL_S = 8.0, 15.0
# part 8's arms: figures key, folder under WORK, what was carried
CARRIED = (("carried", "carried", "a carried compile cache, bytecode directory empty"),
           ("carried_arm_pool", "carried-arm-pool",
            "a carried compile cache, bytecode directory empty, its pool started with the arm "
            "(MOE_PERF_BYTECODE_POOL=arm)"),
           ("carried_bytecode", "carried-bytecode",
            "a carried compile cache and bytecode directory"))  # fmt: skip


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def arm(run: dict, arm_dir: Path) -> dict:
    """One bench_startup.py run: its walls, step 1, the measured steps, and what is not
    measurement (the arm's wall less its measured steps)."""
    record = read_json(arm_dir / "metrics.json") or {}
    startup = read_json(arm_dir / "startup.json") or {}
    return {
        "command_s": run["command_wall_s"],
        "arm_s": run["arm_wall_s"],
        "step1_s": run["step1_s"],
        "measured_s": run["measured_steps_s"],
        "not_measured_s": round(run["arm_wall_s"] - run["measured_steps_s"], 2),
        "losses": [s["loss"] for s in record.get("steps", [])],
        "attention_warm_up": startup.get("attention_warm_up"),
        "early_cuda_context": startup.get("early_cuda_context"),
        "preloaded": (record.get("preload") or {}).get("preloaded"),
        "main_s": (startup.get("marks_s") or {}).get("main"),  # the trainer's imports done
    }


def startup_arms(bench_dir: Path) -> list[dict]:
    runs = (read_json(bench_dir / "startup.json") or {}).get("runs", [])
    return [arm(run, bench_dir / f"run{i}") for i, run in enumerate(runs, 1)]


def sweep_arms(bench_dir: Path) -> list[dict]:
    """The arms of one bench_startup.py --pairs sweep, in the order they ran (`position` 1 is
    the sweep's first arm), each with the sweep's command wall."""
    runs = (read_json(bench_dir / "startup.json") or {}).get("runs", [])
    arms = []
    for position, run in enumerate(runs[0] if runs else [], 1):
        found = sorted((bench_dir / "run1").glob(f"*/*-{'-'.join(run['arm'])}"))
        if found:
            arms.append({**arm(run, found[0]), "position": position})
    return arms


def variants(parent: Path, read) -> dict[str, list[dict]]:
    """{variant: [its runs in order]} from the `parent`/<variant>-<i> folders."""
    found: dict[str, list[dict]] = {}
    folders = sorted(parent.glob("*-*"), key=lambda f: f.name) if parent.is_dir() else []
    for folder in folders:
        name, _, i = folder.name.rpartition("-")
        runs = read(folder) if i.isdigit() else []
        if runs:
            found.setdefault(name, []).extend(runs)
    return found


def trainer_run(folder: Path) -> list[dict]:
    """bench_trainer.py's figures of one run, and its step losses (console.log)."""
    bench = read_json(folder / "bench.json")
    if bench is None:
        return []
    log = (folder / "console.log").read_text(errors="replace").splitlines()
    steps = [s for s in map(contract.parse_step, log) if s]
    keys = ("tokens_per_s", "tflops", "peak_mem_gib", "step_time_s")
    return [{**{k: bench[k] for k in keys}, "losses": [s["loss"] for s in steps]}]


def spread(runs: list[dict], key: str) -> dict:
    values = [r[key] for r in runs if r.get(key) is not None]
    if not values:
        return {}
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}  # fmt: skip


def ab(off: list[dict], on: list[dict], keys: tuple[str, ...]) -> dict:
    """Per key: each side's median and range, the difference of the medians (on - off) and
    its share of off's; and the largest step-loss difference within and across the sides."""
    result = {}
    for key in keys:
        a, b = spread(off, key), spread(on, key)
        if a and b:
            diff = b["median"] - a["median"]
            result[key] = {"off": a, "on": b, "diff": diff, "diff_pct": 100 * diff / a["median"]}
    result["loss_diff"] = {
        "within_off": max_loss_diff(off, off),
        "within_on": max_loss_diff(on, on),
        "across": max_loss_diff(off, on),
    }
    return result


def preload_compare(off: list[dict], on: list[dict]) -> dict:
    """launcher.preload off against on: the sweeps' first arms, their later (warm) arms, and
    the sweeps' command walls."""
    first = [[a for a in side if a["position"] == 1] for side in (off, on)]
    later = [[a for a in side if a["position"] > 1] for side in (off, on)]
    keys = ("arm_s", "step1_s", "not_measured_s")
    walls = [[{"command_s": a["command_s"], "losses": []} for a in side if a["position"] == 1]
             for side in (off, on)]  # fmt: skip
    return {"first": ab(*first, keys), "warm": ab(*later, keys),
            "sweep": ab(*walls, ("command_s",)),
            "served": {"off": sum(bool(a["preloaded"]) for a in off),
                       "on": sum(bool(a["preloaded"]) for a in on),
                       "arms_on": len(on)}}  # fmt: skip


def max_loss_diff(a: list[dict], b: list[dict]) -> float | None:
    pairs = [(x, y) for x in a for y in b if x is not y and x["losses"] and y["losses"]]
    diffs = [abs(p - q) for x, y in pairs for p, q in zip(x["losses"], y["losses"], strict=False)]
    return max(diffs) if diffs else None


def figures(work: Path) -> dict:
    fig: dict = {"meta": read_json(work / "meta.json") or {}}
    fig["arms"] = startup_arms(work / "startup")
    page_cache = work / "page_cache.txt"
    for key, folder, _ in CARRIED:
        carried = startup_arms(work / folder)
        if carried:
            fig[key] = {**carried[0], "page_cache": page_cache.read_text().strip()
                        if page_cache.is_file() else None}  # fmt: skip
    warm = variants(work / "warmup", startup_arms)
    if warm.get("off") and warm.get("on"):
        fig["switch_ab"] = {**warm, "compare": ab(warm["off"], warm["on"],
                                                          ("arm_s", "step1_s"))}  # fmt: skip
    cold = variants(work / "cold", startup_arms)
    if cold.get("off") and cold.get("on"):
        fig["switch_cold_ab"] = {**cold, "compare": ab(cold["off"], cold["on"],
                                                               ("arm_s", "step1_s"))}  # fmt: skip
    preload = variants(work / "preload", sweep_arms)
    if preload.get("off") and preload.get("on"):
        fig["preload_ab"] = {**preload, **preload_compare(preload["off"], preload["on"])}
    later = [a for a in preload.get("on", []) if a["position"] > 1]
    if later:  # today's default on a GPU: the warm arms' goal, with or without an A/B
        fig["preload_warm"] = {
            **{k: spread(later, k) for k in ("arm_s", "step1_s", "not_measured_s")},
            "under_goal": sum(a["arm_s"] < WARM_ARM_GOAL_S for a in later),
        }
    walls = (read_json(work / "runner-bytecode" / "runner_bytecode.json") or {}).get("walls_s")
    if walls:
        fig["runner_bytecode"] = {condition: {name: spread([{"s": w} for w in values], "s")
                                              for name, values in commands.items()}
                                  for condition, commands in walls.items()}  # fmt: skip
    steps = variants(work / "trainer", trainer_run)
    fig["trainer"] = steps
    if steps.get("fp8") and steps.get("fp8mw"):
        fig["fp8_master_weights_ab"] = ab(steps["fp8"], steps["fp8mw"], ("tokens_per_s", "tflops"))
    titan = work / "titan" / "bench.txt"
    fig["torchtitan"] = titan.read_text() if titan.is_file() else None
    skipped = work / "skipped.txt"
    fig["skipped"] = skipped.read_text().splitlines() if skipped.is_file() else []
    return fig


# --- the page ---------------------------------------------------------------------------------


def arms_table(arms: list[dict], labels: list[str]) -> list[str]:
    lines = ["| arm | command | arm wall | step 1 | measured steps | not measured |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for label, a in zip(labels, arms, strict=False):
        cells = [f"{a['command_s']:.1f} s", f"**{a['arm_s']:.1f} s**", f"{a['step1_s']:.2f} s",
                 f"{a['measured_s']:.2f} s", f"{a['not_measured_s']:.1f} s"]  # fmt: skip
        lines.append(f"| {label} | {' | '.join(cells)} |")
    return lines


def trainer_table(steps: dict[str, list[dict]]) -> list[str]:
    lines = ["| variant | run | tokens/s | TFLOP/s | peak GiB | step s |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, runs in steps.items():
        for i, r in enumerate(runs, 1):
            lines.append(f"| {name} | {i} | {r['tokens_per_s']:,.0f} | {r['tflops']:.1f} | "
                         f"{r['peak_mem_gib']:.2f} | {r['step_time_s']:.4f} |")  # fmt: skip
    return lines


def side(x: dict, unit: str) -> str:
    return f"{x['median']:.4g}{unit} ({x['min']:.4g}-{x['max']:.4g}, n={x['n']})"


def ab_lines(title: str, compare: dict, unit: dict[str, str]) -> list[str]:
    lines = [f"{title}:"]
    for key, c in compare.items():
        if key == "loss_diff":
            continue
        u = unit[key]
        lines.append(f"- {key}: off {side(c['off'], u)}, on {side(c['on'], u)}: on - off = "
                     f"{c['diff']:+.4g}{u} ({c['diff_pct']:+.2f}%)")  # fmt: skip
    d = compare["loss_diff"]
    lines.append(f"- largest step-loss difference: within off {d['within_off']}, within on "
                 f"{d['within_on']}, off against on {d['across']}")  # fmt: skip
    return lines


def goals(fig: dict) -> list[str]:
    arms, lines = fig["arms"], []
    if arms:
        carried = (
            " (its compile cache carried from another machine)"
            if fig["meta"].get("seed_cache")
            else ""
        )
        lines.append(f"- the machine's first arm{carried}: {arms[0]['arm_s']:.1f} s (goal under "
                     f"{FIRST_ARM_GOAL_S:g} s)")  # fmt: skip
    if len(arms) > 1:
        walls = ", ".join(f"{a['arm_s']:.1f} s" for a in arms[1:])
        rest = ", ".join(f"{a['not_measured_s']:.1f} s" for a in arms[1:])
        lines.append(f"- warm arms: {walls} (goal under {WARM_ARM_GOAL_S:g} s); not "
                     f"measurement: {rest}")  # fmt: skip
    for key, _, what in CARRIED:
        if key in fig:
            c = fig[key]
            lines.append(f"- the machine's first arm with {what} (part 8, page cache "
                         f"{c['page_cache']}): {c['arm_s']:.1f} s, step 1 {c['step1_s']:.2f} s, "
                         f"the trainer's imports done at {c['main_s']} s (goal under "
                         f"{FIRST_ARM_GOAL_S:g} s)")  # fmt: skip
    if "preload_warm" in fig:
        warm, under = fig["preload_warm"]["arm_s"], fig["preload_warm"]["under_goal"]
        lines.append(f"- warm arms with launcher.preload: {side(warm, ' s')}, {under} of "
                     f"{warm['n']} under the goal ({WARM_ARM_GOAL_S:g} s)")  # fmt: skip
    steps = fig["trainer"]
    for fp8 in ("fp8", "fp8mw"):
        if steps.get("bf16") and steps.get(fp8):
            bf16 = spread(steps["bf16"], "tokens_per_s")["median"]
            ratio = spread(steps[fp8], "tokens_per_s")["median"] / bf16
            lines.append(f"- {fp8} / bf16 tokens/s (medians): {ratio:.3f}")
    return lines


def page(fig: dict) -> str:
    return "\n".join(page_head(fig) + page_tail(fig)) + "\n"


def page_head(fig: dict) -> list[str]:
    meta = fig["meta"]
    out = [
        "# Time to a decision: one GPU run", "",
        f"Commit {meta.get('commit')}, {meta.get('card')}, torch {meta.get('torch')}, "
        f"torchao {meta.get('torchao')}, Python {meta.get('python')}, {meta.get('date')}.",
        f"Command: `{meta.get('command')}` ({meta.get('mode')}).", "", "## Goals", "",
    ]  # fmt: skip
    out += goals(fig)
    n = len(fig["arms"])
    first = "the machine's first"
    if meta.get("seed_cache"):
        first += f" (compile cache carried: {meta['seed_cache']})"
    labels = [first] + [f"warm {i}" for i in range(2, n + 1)]
    arms = fig["arms"]
    for key, _, what in CARRIED:
        if key in fig:
            arms = [*arms, fig[key]]
            labels.append(f"the machine's first with {what} (part 8)")
    out += ["", "## Arms (bench_startup.py)", "", *arms_table(arms, labels)]
    out += [
        "",
        "Where a warm arm's seconds go: breakdown.txt, and a cold arm's (part 7): "
        "breakdown-cold.txt (bench/startup_breakdown.py).",
    ]
    out += ["", "## The reference trainer's step (bench_trainer.py)", ""]
    out += trainer_table(fig["trainer"])
    switch = meta.get("switch", "trainer.warm_attention")  # runs before the switch was named
    sections = (("switch_ab", f"{switch}, warm arms (off, on, on, off)"),
                ("switch_cold_ab", f"{switch}, cold arms"))  # fmt: skip
    for key, title in sections:
        if key in fig:
            out += ["", *ab_lines(title, fig[key]["compare"], {"arm_s": " s", "step1_s": " s"})]
            out += helpers_lines(fig[key]["on"])
    if "preload_ab" in fig:
        out += ["", *preload_lines(fig["preload_ab"])]
    if "runner_bytecode" in fig:
        out += ["", *runner_bytecode_lines(fig["runner_bytecode"])]
    return out


def runner_bytecode_lines(walls: dict) -> list[str]:
    def cell(s: dict) -> str:
        return f"{s['median']:.2f} s [{s['min']:.2f}-{s['max']:.2f}], n={s['n']}"

    lines = ["## The runner's own imports (bench_runner_bytecode.py)", "",
             "| command | bytecode kept | compiled anew |", "| --- | ---: | ---: |"]  # fmt: skip
    for name in walls["kept"]:
        lines.append(f"| {name} | {cell(walls['kept'][name])} | {cell(walls['compiled'][name])} |")
    return lines


def preload_lines(pre: dict) -> list[str]:
    units = {"arm_s": " s", "step1_s": " s", "not_measured_s": " s", "command_s": " s"}
    served = pre["served"]
    return [
        "## launcher.preload on sweeps of two A/A pairs (off, on, ...)", "",
        *ab_lines("the sweep's first arm", pre["first"], units), "",
        *ab_lines("the sweep's later arms", pre["warm"], units), "",
        *ab_lines("the sweep (the command's wall)", pre["sweep"], units)[:-1],
        f"- arms forked from the preloaded interpreter: {served['on']} of {served['arms_on']} "
        f"with it on, {served['off']} with it off",
    ]  # fmt: skip


def helpers_lines(arms: list[dict]) -> list[str]:
    """What the start-up's helper threads of the switched-on arms did (startup.json)."""
    lines = []
    for key, what in (("attention_warm_up", "the attention warm-up"),
                      ("early_cuda_context", "the early CUDA context")):  # fmt: skip
        found = [a[key] for a in arms if a.get(key)]
        if found:
            lines.append(f"- {what} (seconds, build's wait, error): {json.dumps(found)}")
    return lines


def page_tail(fig: dict) -> list[str]:
    out = []
    if "fp8_master_weights_ab" in fig:
        units = {"tokens_per_s": "", "tflops": ""}
        out += ["", *ab_lines("trainer.fp8_master_weights under dtype=fp8",
                              fig["fp8_master_weights_ab"], units)]  # fmt: skip
    if fig["torchtitan"]:
        out += ["", "## torchtitan (bench_frameworks.sh)", "", "```", fig["torchtitan"], "```"]
    if fig["skipped"]:
        out += ["", "## Not run", "", *(f"- {line}" for line in fig["skipped"])]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", type=Path)
    p.add_argument("out", type=Path)
    args = p.parse_args(argv)
    fig = figures(args.work)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "figures.json").write_text(json.dumps(fig, indent=1) + "\n")
    (args.out / "summary.md").write_text(page(fig))
    for name in ("breakdown", "breakdown-cold"):
        arm_dir = args.work / name / "run1"
        if (arm_dir / "metrics.json").is_file():
            with (args.out / f"{name}.txt").open("w") as f:
                startup_breakdown.show(startup_breakdown.breakdown(arm_dir), out=f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
