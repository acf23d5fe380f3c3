#!/usr/bin/env bash
# Time to answer before/after on one machine: bench_startup.py with a base tree's trainer and
# with this tree's, one run at a time, interleaved: an untimed priming run first (a fresh
# machine's first arm also compiles Python's bytecode where the environment forbids it beside the
# sources, 5 s on an H100 VM, which would fall on whichever tree runs first), then two cold pairs
# in both orders (base, this, this, base; each cold run with an empty compile cache of its own),
# then warm pairs. The base runs from `git archive BASE` with this tree's bench_startup.py copied
# in, so both use the same bench.
#
#   bash bench/bench_startup_ab.sh BASE OUT_DIR [WARM_PAIRS (2) [bench_startup.py args]]
#
# BASE: a commit of this repository, or a directory holding `git archive` of one (pyproject.toml,
# moe_perf, conf, bench, hydra_plugins), e.g. on a machine without this repository's history.
# OUT_DIR gets base1.json, this1.json, this1b.json, base1b.json (the cold runs), base2.json, ...
# (bench_startup.py's startup.json of each run) and
# prints each run's line; the step losses of every run are printed last (the same per step
# when the change keeps numerics, up to the GPU's run-to-run noise).
set -euo pipefail
base=$1 out=$(realpath -m "$2") pairs=${3:-2}
extra=("${@:4}")  # e.g. --set model=tiny ... (bench_startup.py)
here=$(cd "$(dirname "$0")/.." && pwd)
mkdir -p "$out"
tree=$(mktemp -d)
trap 'rm -rf "$tree"' EXIT
if [[ -d $base ]]; then
  cp -r "$base"/. "$tree"
else
  git -C "$here" archive "$base" pyproject.toml moe_perf conf bench hydra_plugins | tar -x -C "$tree"
fi
cp "$here/bench/bench_startup.py" "$tree/bench/"
one() {  # NAME ROOT [bench args]
  local name=$1 root=$2
  shift 2
  echo "== $name ($root)"
  python3 "$root/bench/bench_startup.py" "$out/$name" --runs 1 "$@" "${extra[@]}"
  cp "$out/$name/startup.json" "$out/$name.json"
}
echo "== priming run (not timed: it leaves Python's bytecode for every run after it)"
python3 "$here/bench/bench_startup.py" "$out/prime" --runs 1 "${extra[@]}" \
  --set training.max_steps=2 --cache "$out/cache-prime" > "$out/prime.log"
one base1 "$tree" --cache "$out/cache-base"
one this1 "$here" --cache "$out/cache-this"
one this1b "$here" --cache "$out/cache-this-b"
one base1b "$tree" --cache "$out/cache-base-b"
for i in $(seq 2 $((pairs + 1))); do
  one "base$i" "$tree" --cache "$out/cache-base" --warm
  one "this$i" "$here" --cache "$out/cache-this" --warm
done
echo "== losses per step"
for f in "$out"/base*/run1/metrics.json "$out"/this*/run1/metrics.json; do
  python3 -c 'import json, sys; print(sys.argv[2], [s["loss"] for s in json.load(open(sys.argv[1]))["steps"]])' "$f" "$(basename "$(dirname "$(dirname "$f")")")"
done
