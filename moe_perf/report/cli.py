"""`python -m moe_perf.compare`: a sweep directory, or two sides (logs, metrics.json files, arm
or sweep directories).

python -m moe_perf.compare SWEEP_DIR            re-print (and re-write) a sweep's comparison
python -m moe_perf.compare SWEEP_DIR --sweep ID an earlier sweep's, kept in SWEEP_DIR/previous/ID
python -m moe_perf.compare BASE FEAT            two console logs or metrics.json files, each
                                                log's format detected (moe_perf/logs),
                                                two arm directories, or two sweep directories
                                                of one arm each (single runs, or repeats)
python -m moe_perf.compare BASE FEAT --global-batch 32 --seq-length 2048 --world-size 8
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from moe_perf.logs import FORMATS, REGEX_TIMING, RunShape, UnknownFormat, line_parser
from moe_perf.report.comparison import compare_records, compare_sweep, load_arm, load_sweep
from moe_perf.report.render import render, write_outputs
from moe_perf.report.results.arm import ArmRecord
from moe_perf.report.results.files import strict_json
from moe_perf.report.sweep import find_sweep


def _short(path: Path) -> str:
    """`<arm dir>/console.log`: runner logs are all named console.log."""
    return f"{path.parent.name}/{path.name}" if path.parent.name else path.name


def _format_of(record: ArmRecord) -> str:
    # records written before the runner read other formats all came from contract lines
    return record.log_format or "contract"


def check_same_format(records: list[ArmRecord], paths: list[Path]) -> None:
    """Two frameworks' figures mean different things (global or per-device tokens/s, what a
    step is, which memory): refused, in one line."""
    formats = [_format_of(r) for r in records]
    if len(set(formats)) > 1:
        shown = " and ".join(f"{p} is {f}" for p, f in zip(paths, formats, strict=True))
        raise ValueError(
            f"not compared: {shown}; logs of two frameworks or formats do not measure the same "
            f"things (give two logs of one format, or --format to read both one way)"
        )


def load_sweep_side(sweep_dir: Path, arm: str) -> list[ArmRecord]:
    """The records of a sweep directory's current sweep as one side: every run of one arm (a
    single run of `python -m moe_perf`, or its repeats), all compared as `arm`."""
    records, _ = load_sweep(sweep_dir)
    if not records:
        raise ValueError(f"{sweep_dir}: no metrics.json or console.log, and no arm record of "
                         f"a sweep under it")  # fmt: skip
    arms = sorted({str(r.arm) for r in records})
    if len(arms) > 1:
        example = Path(records[0].path).parent
        raise ValueError(
            f"{sweep_dir} holds the arms {' and '.join(arms)} of one sweep: give it alone to "
            f"compare them (python -m moe_perf.compare {sweep_dir}), or one arm directory per "
            f"side, e.g. {example}"
        )
    return [dataclasses.replace(record, arm=arm) for record in records]


def load_side(path: Path, arm: str, fmt: str, shape: RunShape | None) -> list[ArmRecord]:
    """One side of BASE FEAT: a console log or metrics.json file; an arm directory (its
    metrics.json, else its console.log); or a sweep directory of runs of one arm."""
    if path.is_dir():
        for name in ("metrics.json", "console.log"):
            if (path / name).is_file():
                return [load_arm(path / name, arm, fmt, shape)]
        return load_sweep_side(path, arm)
    return [load_arm(path, arm, fmt, shape)]


def compare_paths(base: Path, feat: Path, fmt: str = "auto", out_dir: Path | None = None,
                  shape: RunShape | None = None) -> tuple[dict, str]:  # fmt: skip
    """(report, text) for two logs, metrics.json files, arm or sweep directories."""
    records = load_side(base, "base", fmt, shape) + load_side(feat, "feat", fmt, shape)
    check_same_format(records, [Path(r.path) for r in records])
    keys = {(r.model, r.tag) for r in records}
    if len(records) == 2 and (len(keys) > 1 or keys == {("-", "-")}):
        # two files named on purpose: compare them as one group
        records = [dataclasses.replace(r, model="files", tag=f"{_short(base)} vs {_short(feat)}")
                   for r in records]  # fmt: skip
    notes = []
    for record in records:
        how = "; ".join(record.derivations)
        notes.append(f"{record.arm}: {record.path} ({_format_of(record)})"
                     + (f": {how}" if how else ""))  # fmt: skip
    report = compare_records(records, notes)
    if out_dir is not None:
        report = write_outputs(report, out_dir)
    return report, render(report)


COMPARE_HELP = """\
Compare base and feat without running anything: a sweep directory of `python -m moe_perf`
(re-prints and re-writes its comparison), or BASE and FEAT: two arm directories, two sweep
directories of one arm each, or two console logs or metrics.json files, each log's format
detected (moe_perf's contract lines, torchtitan, Megatron-LM, NeMo) or given.
Median step time, tokens/s and peak memory per arm, first step dropped, and the difference."""

COMPARE_EPILOG = """\
examples:
  python -m moe_perf.compare outputs/validate-performance
  python -m moe_perf.compare outputs/validate-performance/tiny/<tag>-base \
                             outputs/validate-performance/tiny/<tag>-feat
  python -m moe_perf.compare base/console.log feat/console.log --out cmp/
  python -m moe_perf.compare base.log feat.log --global-batch 32 --seq-length 2048 --world-size 8

outputs: comparison.md, comparison.json and comparison.png in SWEEP_DIR (or --out DIR); the
text is printed.

exit codes: 0 compared (also when an arm's runs failed: the comparison says so); 2 the
inputs cannot be read or compared (a missing file, two formats, a bad --format regex)."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m moe_perf.compare",
        description=COMPARE_HELP,
        epilog=COMPARE_EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "paths",
        nargs="+",
        type=Path,
        help="SWEEP_DIR, or BASE FEAT (files, arm or sweep directories)",
    )
    p.add_argument(
        "--format",
        default="auto",
        help=f"auto (detected per file), {', '.join(FORMATS)}, or a regex with named groups",
    )
    p.add_argument("--global-batch", type=int, help="sequences per optimizer step (all ranks)")
    p.add_argument("--seq-length", type=int, help="tokens per sequence")
    p.add_argument("--world-size", type=int, help="devices of the run (per-device figures)")
    p.add_argument("--out", type=Path, help="also write comparison.json/.md/.png here")
    p.add_argument("--no-write", action="store_true", help="SWEEP_DIR: print only")
    p.add_argument(
        "--sweep",
        metavar="ID",
        help="SWEEP_DIR: the sweep of this id (an earlier one is kept in previous/ID)",
    )
    p.add_argument("--json", action="store_true", help="print comparison.json instead")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    shape = RunShape(args.global_batch, args.seq_length, args.world_size)
    try:
        if args.format != "auto":
            line_parser(args.format)  # a bad regex is named before any file is read
        if len(args.paths) == 1 and args.paths[0].is_dir():
            where = find_sweep(args.paths[0], args.sweep) if args.sweep else args.paths[0]
            report, text = compare_sweep(where, write=not args.no_write)
        elif len(args.paths) == 2:
            base, feat = args.paths
            report, text = compare_paths(base, feat, args.format, args.out, shape)
        else:
            print("give a sweep directory, or two files: BASE FEAT", file=sys.stderr)
            return 2
    except UnknownFormat as exc:
        print(f"moe_perf.compare: {exc}; if it prints its steps another way, give the format "
              f"with --format '<regex with named groups>': (?P<step>...) and one of "
              f"{', '.join(f'(?P<{g}>...)' for g in REGEX_TIMING)}, e.g. --format "
              f"'iter (?P<step>[0-9]+) took (?P<step_time_ms>[0-9.]+) ms' (or --format "
              f"{'|'.join(FORMATS)} to read it as one of those)", file=sys.stderr)  # fmt: skip
        return 2
    except (OSError, ValueError) as exc:
        print(f"moe_perf.compare: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a record the checks let through: one line, never a traceback
        print(f"moe_perf.compare: could not compare ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    print(strict_json(report.to_dict()) if args.json else text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
