"""`python -m moe_perf.compare`: a sweep directory, or two logs / metrics.json files.

python -m moe_perf.compare SWEEP_DIR            re-print (and re-write) a sweep's comparison
python -m moe_perf.compare BASE FEAT            two console logs or metrics.json files
python -m moe_perf.compare BASE FEAT --format titan --tokens-per-step 8192
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from moe_perf.report import logparse
from moe_perf.report.comparison import compare_records, compare_sweep, load_arm
from moe_perf.report.render import render, write_outputs


def _short(path: Path) -> str:
    """`<arm dir>/console.log`: runner logs are all named console.log."""
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def compare_paths(
    base: Path, feat: Path, fmt: str = "auto", out_dir: Path | None = None, **options
) -> tuple[dict, str]:
    """(report, text) for two logs or metrics.json files, compared as one group."""
    records = [load_arm(base, "base", fmt, **options), load_arm(feat, "feat", fmt, **options)]
    keys = {(r.get("model"), r.get("tag")) for r in records}
    if len(keys) > 1 or keys == {("-", "-")}:
        for record in records:  # two files named on purpose: compare them as one group
            record["model"], record["tag"] = "files", f"{_short(base)} vs {_short(feat)}"
    notes = [f"{r['arm']}: {r['_path']} ({r.get('log_format', 'metrics.json')})" for r in records]
    report = compare_records(records, notes)
    if out_dir is not None:
        write_outputs(report, out_dir)
    return report, render(report)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_perf.compare",
        description="Compare base and feat: a sweep directory, or two logs / metrics.json files.",
    )
    p.add_argument("paths", nargs="+", type=Path, help="SWEEP_DIR, or BASE FEAT")
    p.add_argument("--format", default="auto", choices=("auto", *logparse.FORMATS))
    p.add_argument("--seq-length", type=int, help="Megatron logs: tokens/s = batch*seq/time")
    p.add_argument(
        "--tokens-per-step", type=float, help="torchtitan logs: tokens per step per device"
    )
    p.add_argument("--out", type=Path, help="also write comparison.json/.md/.png here")
    p.add_argument("--no-write", action="store_true", help="SWEEP_DIR: print only")
    p.add_argument("--json", action="store_true", help="print comparison.json instead")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    options = {"seq_length": args.seq_length, "tokens_per_step": args.tokens_per_step}
    try:
        if len(args.paths) == 1 and args.paths[0].is_dir():
            report, text = compare_sweep(args.paths[0], write=not args.no_write)
        elif len(args.paths) == 2:
            base, feat = args.paths
            report, text = compare_paths(base, feat, args.format, args.out, **options)
        else:
            print("give a sweep directory, or two files: BASE FEAT", file=sys.stderr)
            return 2
    except (OSError, ValueError) as exc:
        print(f"moe_perf.compare: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2, default=str) if args.json else text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
