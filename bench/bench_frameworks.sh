#!/usr/bin/env bash
# trainer=torchtitan through the real command on one GPU: an A/A sweep, a sweep against a branch
# with a slowdown planted in torchtitan's own train step, and the reference trainer on the same
# shapes (4-layer qwen3-30b-a3b, seq 2048, global batch 32, compiled, forced balance).
#
#   bash bench/bench_frameworks.sh TITAN_TREE OUT_DIR [PLANT_MS]
#
# TITAN_TREE: a torchtitan 0.2.2 source tree (torchtitan/ and tests/assets/tokenizer/); it is
# copied into a fresh git repository (branch main), a branch `planted` adds a GPU spin of
# PLANT_MS (default 30, about 4% of a 0.74 s step) in every train step, right before the
# optimizer step, calibrated here with CUDA events. torchtitan's c4_test loader reads seeded synthetic JSON lines written
# into tests/assets/c4_test. Each sweep directory (records, console logs, comparison.md) lands
# in OUT_DIR; bench.txt there collects the comparisons. SWEEPS (below) picks the sweeps.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)  # bench/, before any cd

TREE=$(cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
PLANT_MS=${3:-30}
PY=${PYTHON:-python}
STEPS=${STEPS:-10}
MICRO=${MICRO:-16}  # micro-batch / torchtitan's local batch (8 fits an 80 GB H100)

WORK=$(mktemp -d)
REPO=$WORK/torchtitan
PYTHON=$PY bash "$HERE/make_titan_repo.sh" "$TREE" "$REPO"
cd "$REPO"

# The plant: torch.cuda._sleep(cycles) spins on the GPU stream, so it is not hidden behind
# queued GPU work the way a host sleep is; cycles per millisecond measured here. It goes right
# before the optimizer step, where the host has queued the whole backward ahead of the GPU. At
# the start of train_step (the first try) the GPU is idle while the host loads and tokenizes
# the step's micro-batches, and a 30 ms spin there hid entirely in that gap (read as -0.05%).
CYCLES=$("$PY" "$HERE/gpu_spin_cycles.py" "$PLANT_MS")
git checkout -q -b planted
"$PY" - torchtitan/train.py "$CYCLES" <<'EOF'
import sys
path, cycles = sys.argv[1], sys.argv[2]
src = open(path).read()
anchor = "        self.optimizers.step()\n"
assert src.count(anchor) == 1, "train_step's optimizer step moved: update the plant"
plant = f"        torch.cuda._sleep({cycles})  # moe_perf bench: planted slowdown\n"
open(path, "w").write(src.replace(anchor, plant + anchor))
EOF
git -c user.name=bench -c user.email=bench@moe-perf.invalid commit -q -am "plant: ${PLANT_MS} ms GPU spin per train step"
git checkout -q main
echo "plant: ${PLANT_MS} ms = ${CYCLES} spin cycles per step, in torchtitan/train.py train_step" | tee "$OUT/bench.txt"

SHAPES=(model=qwen3-30b-a3b model.num_layers=4 mesh=single training.sequence_length=2048
        training.global_batch=32 "training.max_steps=$STEPS" routing=balanced
        "training.micro_batch=$MICRO" trainer.compile=true wandb.mode=disabled timeout_s=900)

sweep() {  # name, overrides...
  local name=$1; shift
  echo "== $name: python -m moe_perf $* -m arm=base,feat" | tee -a "$OUT/bench.txt"
  local t0=$EPOCHREALTIME
  "$PY" -m moe_perf "$@" "hydra.sweep.dir=$OUT/$name" -m arm=base,feat 2>&1 | tee "$OUT/$name.log"
  # the wait for the answer, and how much of it is measured steps (step 1 is not)
  "$PY" - "$OUT/$name" "$t0" "$EPOCHREALTIME" <<'PYEOF' | tee -a "$OUT/bench.txt"
import json, pathlib, sys
wall = float(sys.argv[3]) - float(sys.argv[2])
recs = [json.loads(p.read_text()) for p in pathlib.Path(sys.argv[1]).glob("*/*/metrics.json")]
steps = sum(sum(s["step_time_s"] for s in r["steps"][1:]) for r in recs)
arms = ", ".join(f"{r['arm']} {r['wall_time_s']:.1f} s" for r in sorted(recs, key=lambda r: r["started"]))
print(f"sweep wall {wall:.1f} s (arms: {arms}); measured steps {steps:.1f} s = {100 * steps / wall:.1f}%")
PYEOF
  cat "$OUT/$name/comparison.md" >> "$OUT/bench.txt" 2>/dev/null || echo "(no comparison)" >> "$OUT/bench.txt"
}

# SWEEPS picks and orders them; titan_explain is the planted sweep with explain=true
# (torchtitan's profiler over the last measured steps, read back as a per-category breakdown)
for name in ${SWEEPS:-titan_aa titan_planted reference}; do
  case $name in
    titan_aa) sweep titan_aa trainer=torchtitan "${SHAPES[@]}" refs.base=main refs.feat=main ;;
    titan_planted) sweep titan_planted trainer=torchtitan "${SHAPES[@]}" refs.base=main refs.feat=planted ;;
    titan_explain) sweep titan_explain trainer=torchtitan "${SHAPES[@]}" refs.base=main refs.feat=planted explain=true ;;
    # the reference trainer on the same shapes (micro-batch 16, its fastest on one H200); its
    # code is not in this repository, so both arms run the installed moe_perf trainer (an A/A)
    reference) sweep reference trainer=reference "${SHAPES[@]}" refs.base=main refs.feat=main ;;
    *) echo "SWEEPS: unknown sweep $name (titan_aa titan_planted titan_explain reference)" >&2; exit 2 ;;
  esac
done
