#!/usr/bin/env bash
# The reference trainer's step before/after on one machine: bench_trainer.py with a base tree's
# trainer and with this tree's, per configuration one after the other (base, then this), each
# with one profiled step after the measured ones.
#
#   bash bench/bench_trainer_ab.sh BASE[,BASE2...] OUT_DIR
#
# BASE: a commit of this repository (extracted with `git archive`) or a directory holding such
# a tree (pyproject.toml, moe_perf, conf, bench, hydra_plugins), copied to a temporary
# directory with this tree's bench_trainer.py and profile_summary.py put in, so every variant
# runs the same bench. Several bases, comma-separated, run in that order before this tree
# (variants base, base2, ...): e.g. the issue's baseline and the last commit before a change.
# CONFIGS: bench_trainer.py arguments per configuration, separated by ';' (default below).
# PYTHON: the interpreter with torch (default python3).
# OUT_DIR gets <config>-<base|base2|...|this>/ (bench.json, profile/summary.md) and
# summary.txt, one line per run: step time, tokens/s, TFLOP/s, peak memory.
set -euo pipefail
IFS=',' read -r -a bases <<<"$1"
out=$(realpath -m "$2")
here=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
CONFIGS=${CONFIGS:-"--layers 4 --micro-batch 16;--layers 8 --micro-batch 8"}
mkdir -p "$out"
trees=$(mktemp -d)
trap 'rm -rf "$trees"' EXIT
variants=()
declare -A root_of=([this]=$here)
for i in "${!bases[@]}"; do
  base=${bases[$i]} name=base$((i + 1))
  [[ $name == base1 ]] && name=base
  tree=$trees/$name
  mkdir -p "$tree"
  if [[ -d $base ]]; then
    cp -r "$base"/. "$tree"
  else
    git -C "$here" archive "$base" pyproject.toml moe_perf conf bench hydra_plugins | tar -x -C "$tree"
  fi
  cp "$here/bench/bench_trainer.py" "$here/bench/profile_summary.py" "$tree/bench/"
  variants+=("$name")
  root_of[$name]=$tree
done
variants+=(this)
IFS=';' read -r -a configs <<<"$CONFIGS"
: >"$out/summary.txt"
i=0
for args in "${configs[@]}"; do
  i=$((i + 1))
  for variant in "${variants[@]}"; do
    root=${root_of[$variant]}
    name="c$i-$variant"
    echo "== $name: bench_trainer.py $args --profile 1 (trainer from $root)"
    # shellcheck disable=SC2086  # $args is a list of options
    "$PY" "$root/bench/bench_trainer.py" $args --profile 1 --out "$out/$name"
    "$PY" - "$out/$name/bench.json" "$name" "$args" >>"$out/summary.txt" <<'EOF'
import json, sys
b = json.load(open(sys.argv[1]))
print(f"{sys.argv[2]:8s} [{sys.argv[3]}] step {b['step_time_s']:.4f} s, {b['tokens_per_s']:,.0f} tokens/s, "
      f"{b['tflops']:.1f} TFLOP/s, peak {b['peak_mem_gib']:.2f} GiB, wall {b['wall_s']} s")
EOF
  done
done
cat "$out/summary.txt"
