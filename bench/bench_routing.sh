#!/usr/bin/env bash
# Step time against routing imbalance on one GPU (docs/routing.md), through the real command:
# the reference trainer on 4 layers of qwen3-30b-a3b (seq 2048, global batch 32, bf16,
# compiled), routing=skew at each of IMBALANCES (grouped GEMM with uneven groups), then the
# router's own top-k (routing=real) and forced balance, every sweep an A/A (base and feat one
# commit) with REPEATS; torchtitan the same where a TITAN_TREE is given.
#
#   bash bench/bench_routing.sh OUT_DIR [TITAN_TREE]
#
# Sweeps (SWEEPS, in order; default "skew real balanced", plus "titan_skew titan_real" with a
# TITAN_TREE):
#   skew        routing=skew -m routing.imbalance=$IMBALANCES repeat=$REPEATS arm=base,feat
#   real        routing=real -m repeat=$REPEATS arm=base,feat
#   balanced    routing=balanced -m repeat=$REPEATS arm=base,feat (the default routing)
#   titan_skew  trainer=torchtitan, routing=skew over IMBALANCES (our plan in its router)
#   titan_real  trainer=torchtitan, routing=real
# The reference trainer runs from a scratch git repository that holds no trainer, so both arms
# run the installed (PYTHONPATH) moe_perf; torchtitan from a repository made of TITAN_TREE
# (bench/make_titan_repo.sh). Each sweep directory (records, console logs, comparison.md,
# comparison.png, comparison_imbalance.png) lands in OUT_DIR/<sweep>; OUT_DIR/bench.txt collects
# the comparisons, the sweeps' wall times and the machine.
#
# Environment: PYTHON (python), STEPS (10), MICRO (8: fits an 80 GB H100; 16 on an H200),
# IMBALANCES (1,1.5,2,4), REPEATS (0,1,2), SHAPE (hot; or zipf), HOT_RANKS (1), EXTRA (more
# overrides for every sweep, e.g. dry_run=true).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)  # bench/, before any cd
ROOT=$(cd "$HERE/.." && pwd)

OUT=$(mkdir -p "$1" && cd "$1" && pwd)
TREE=${2:-}
PY=${PYTHON:-python}
STEPS=${STEPS:-10}
MICRO=${MICRO:-8}
IMBALANCES=${IMBALANCES:-1,1.5,2,4}
REPEATS=${REPEATS:-0,1,2}
DEFAULT_SWEEPS="skew real balanced"
[ -n "$TREE" ] && DEFAULT_SWEEPS="$DEFAULT_SWEEPS titan_skew titan_real"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
read -r -a EXTRA_ARGS <<< "${EXTRA:-}"

WORK=$(mktemp -d)
mkdir "$WORK/scratch"
(cd "$WORK/scratch" && git init -q -b main && echo "bench: no trainer here" > README.md \
  && git add -A && git -c user.name=bench -c user.email=bench@moe-perf.invalid commit -q -m scratch)
if [ -n "$TREE" ]; then
  PYTHON=$PY bash "$HERE/make_titan_repo.sh" "$(cd "$TREE" && pwd)" "$WORK/torchtitan"
fi

{ echo "bench_routing: $(date -Is) moe_perf $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || true
  "$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)'
} | tee "$OUT/bench.txt"

SHAPES=(model=qwen3-30b-a3b model.num_layers=4 mesh=single dtype=bf16
        training.sequence_length=2048 training.global_batch=32 "training.micro_batch=$MICRO"
        "training.max_steps=$STEPS" trainer.compile=true wandb.mode=disabled timeout_s=1200
        refs.base=main refs.feat=main)
SKEW=(routing=skew "routing.shape=${SHAPE:-hot}" "routing.hot_ranks=${HOT_RANKS:-1}")

sweep() {  # name, repository, overrides... (the -m part included)
  local name=$1 repo=$2; shift 2
  echo "== $name: python -m moe_perf $*" | tee -a "$OUT/bench.txt"
  local t0=$EPOCHREALTIME
  # a failed arm (exit 3) is in the comparison; the next sweeps still run
  (cd "$repo" && "$PY" -m moe_perf "$@" "${EXTRA_ARGS[@]}" "hydra.sweep.dir=$OUT/$name") \
    2>&1 | tee "$OUT/$name.log" || echo "(exit status $?)" | tee -a "$OUT/bench.txt"
  awk -v t0="$t0" -v t1="$EPOCHREALTIME" 'BEGIN { printf "sweep wall %.1f s\n", t1 - t0 }' \
    | tee -a "$OUT/bench.txt"
  cat "$OUT/$name/comparison.md" >> "$OUT/bench.txt" 2>/dev/null || echo "(no comparison)" >> "$OUT/bench.txt"
}

for name in ${SWEEPS:-$DEFAULT_SWEEPS}; do
  case $name in
    skew) sweep skew "$WORK/scratch" "${SHAPES[@]}" "${SKEW[@]}" \
            -m "routing.imbalance=$IMBALANCES" "repeat=$REPEATS" arm=base,feat ;;
    real) sweep real "$WORK/scratch" "${SHAPES[@]}" routing=real -m "repeat=$REPEATS" arm=base,feat ;;
    balanced) sweep balanced "$WORK/scratch" "${SHAPES[@]}" -m "repeat=$REPEATS" arm=base,feat ;;
    titan_skew|titan_real)
      [ -n "$TREE" ] || { echo "SWEEPS: $name needs a TITAN_TREE" >&2; exit 2; }
      if [ "$name" = titan_skew ]; then
        sweep titan_skew "$WORK/torchtitan" trainer=torchtitan "${SHAPES[@]}" "${SKEW[@]}" \
          -m "routing.imbalance=$IMBALANCES" "repeat=$REPEATS" arm=base,feat
      else
        sweep titan_real "$WORK/torchtitan" trainer=torchtitan "${SHAPES[@]}" routing=real \
          -m "repeat=$REPEATS" arm=base,feat
      fi ;;
    *) echo "SWEEPS: unknown sweep $name (skew real balanced titan_skew titan_real)" >&2; exit 2 ;;
  esac
done
rm -rf "$WORK"
