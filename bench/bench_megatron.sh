#!/usr/bin/env bash
# trainer=megatron through the real command on one GPU: an A/A sweep and a sweep against a branch
# with a slowdown planted in Megatron-LM's own train_step, without Transformer Engine or Apex
# (--transformer-impl local: torch attention and norms, SequentialMLP experts).
#
#   bash bench/bench_megatron.sh MLM_TREE OUT_DIR [PLANT_MS]
#
# MLM_TREE: a Megatron-LM source tree, or the part pretrain_gpt.py needs (megatron/,
# pretrain_gpt.py, gpt_builders.py, model_provider.py). It is copied into a fresh git repository
# (branch main); a branch `planted` adds a GPU spin of PLANT_MS (default 30) right before
# `optimizer.step()` in megatron/training/training.py train_step, its cycles per millisecond
# measured here with CUDA events on an idle GPU. Each sweep directory lands in OUT_DIR (records,
# console logs, comparison.md); bench.txt there collects the comparisons. SWEEPS picks the sweeps:
# `smoke` (one arm of 3 steps, nothing compared), `mlm_aa`, `mlm_planted` (default: the last two).
# STEPS, LAYERS, GLOBAL_BATCH, MICRO_BATCH change the shapes; REPEATS runs each arm of a compared
# sweep several times, interleaved (REPEATS=0,1,2; default 0: one run per arm); EXTRA adds overrides
# (word-split, e.g. EXTRA=dry_run=true); CYCLES skips the calibration (no GPU needed for a dry run).
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)  # bench/, before any cd

TREE=$(cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
PLANT_MS=${3:-30}
PY=${PYTHON:-python3}
STEPS=${STEPS:-10}
LAYERS=${LAYERS:-2}
REPEATS=${REPEATS:-0}

WORK=$(mktemp -d)
REPO=$WORK/megatron-lm
cp -r "$TREE" "$REPO"
rm -rf "$REPO/.git"
cd "$REPO"
# Megatron builds its dataset helpers (helpers.cpp) with make in every arm's worktree at start-up;
# the built library stays out of the tree
printf '%s\n' '*.so' '__pycache__/' 'megatron/core/datasets/helpers_cpp' > .gitignore
git init -q -b main
git add -A
git -c user.name=bench -c user.email=bench@moe-perf.invalid commit -q -m "Megatron-LM snapshot"

# torch.cuda._sleep spins on the GPU stream (a host sleep would hide behind queued GPU work);
# before optimizer.step() the host has queued the whole backward ahead of the GPU
CYCLES=${CYCLES:-$("$PY" "$HERE/gpu_spin_cycles.py" "$PLANT_MS")}
git checkout -q -b planted
"$PY" - megatron/training/training.py "$CYCLES" <<'EOF'
import re, sys
path, cycles = sys.argv[1], sys.argv[2]
src = open(path).read()
anchor = re.compile(r"^( +)update_successful, grad_norm, num_zeros_in_grad = optimizer\.step\(\)\n", re.M)
found = anchor.findall(src)
assert len(found) == 1, "train_step's optimizer.step() moved: update the plant"
indent = found[0]
plant = f"{indent}torch.cuda._sleep({cycles})  # moe_perf bench: planted slowdown\n"
open(path, "w").write(anchor.sub(lambda m: plant + m.group(0), src, count=1))
EOF
git -c user.name=bench -c user.email=bench@moe-perf.invalid commit -q -am "plant: ${PLANT_MS} ms GPU spin per train step"
git checkout -q main
echo "plant: ${PLANT_MS} ms = ${CYCLES} spin cycles per step, before optimizer.step() in train_step" | tee "$OUT/bench.txt"
echo "megatron-lm repo: $REPO (main $(git rev-parse --short main), planted $(git rev-parse --short planted))" | tee -a "$OUT/bench.txt"

# No Transformer Engine or Apex on the machine: local layers, and the fusions that need them off
# (gradient-accumulation fusion: Apex's fused_weight_gradient_mlp_cuda; rope fusion: TE;
# masked-softmax fusion: Megatron's compiled softmax kernels)
SHAPES=(repo="$REPO" trainer=megatron model=qwen3-30b-a3b "model.num_layers=$LAYERS" mesh=single
        training.sequence_length=2048 "training.global_batch=${GLOBAL_BATCH:-8}"
        "training.micro_batch=${MICRO_BATCH:-4}" "training.max_steps=$STEPS" routing=balanced
        trainer.transformer_impl=local
        'trainer.extra_args=[--no-gradient-accumulation-fusion,--no-rope-fusion,--no-masked-softmax-fusion]'
        wandb.mode=disabled timeout_s=900 ${EXTRA:-})

sweep() {  # name, overrides...
  local name=$1; shift
  echo "== $name: python -m moe_perf $* -m repeat=$REPEATS arm=base,feat" | tee -a "$OUT/bench.txt"
  "$PY" -m moe_perf "$@" "hydra.sweep.dir=$OUT/$name" -m "repeat=$REPEATS" arm=base,feat 2>&1 \
    | tee "$OUT/$name.log" || true
  cat "$OUT/$name/comparison.md" >> "$OUT/bench.txt" 2>/dev/null || echo "(no comparison)" >> "$OUT/bench.txt"
}

for name in ${SWEEPS:-mlm_aa mlm_planted}; do
  case $name in
    smoke)  # one arm, 3 steps: does Megatron start, run and print lines moe_perf reads
      echo "== smoke: python -m moe_perf ${SHAPES[*]} training.max_steps=3" | tee -a "$OUT/bench.txt"
      "$PY" -m moe_perf "${SHAPES[@]}" training.max_steps=3 refs.base=main refs.feat=main \
        "hydra.sweep.dir=$OUT/smoke" -m arm=base 2>&1 | tee "$OUT/smoke.log" || true ;;
    mlm_aa) sweep mlm_aa "${SHAPES[@]}" refs.base=main refs.feat=main ;;
    mlm_planted) sweep mlm_planted "${SHAPES[@]}" refs.base=main refs.feat=planted ;;
    *) echo "SWEEPS: unknown sweep $name (smoke mlm_aa mlm_planted)" >&2; exit 2 ;;
  esac
done
