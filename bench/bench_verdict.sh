#!/usr/bin/env bash
# The verdict on a GPU: the reference trainer at 4 layers of qwen3-30b-a3b, an A/A sweep and
# sweeps against branches with a GPU spin planted in every step, each with pairs added until
# decided (repeat=auto), timed from the command to the verdict.
#
#   bash bench/bench_verdict.sh OUT_DIR [PLANT_MS ...]     (default plants: 5 15)
#
# The arms run this project's own reference trainer from a throwaway git repository holding a
# copy of moe_perf/ (branch main); a branch `spin<ms>` adds `torch.cuda._sleep` of <ms>
# milliseconds (calibrated here with CUDA events) in train.py's bench_hook, inside the timed
# step right before the optimizer step. At micro-batch 8 an H100 step is about 0.5 s, so 5 ms
# and 15 ms are about 1% and 3%. Each sweep directory lands in OUT_DIR; bench.txt there has one
# line per sweep (word, estimate, interval, pairs, wall time) and the comparisons.
# SWEEPS picks the sweeps (aa and spin<ms> names), MICRO the micro-batch, STEPS the steps.
# CPU=1 checks the script itself on a CPU: the tiny model, and a host sleep as the plant.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/.." && pwd)
OUT=$(mkdir -p "$1" && cd "$1" && pwd)
shift
PLANTS=("$@")
[[ ${#PLANTS[@]} -gt 0 ]] || PLANTS=(5 15)
PY=${PYTHON:-python}
STEPS=${STEPS:-10}
MICRO=${MICRO:-8}
GIT=(git -c user.name=bench -c user.email=bench@moe-perf.invalid)

REPO=$(mktemp -d)/repo
mkdir -p "$REPO"
cp -r "$ROOT/moe_perf" "$REPO/moe_perf"
find "$REPO" -name __pycache__ -prune -exec rm -rf {} +
printf '__pycache__/\noutputs/\n' >"$REPO/.gitignore"
cd "$REPO"
"${GIT[@]}" init -q -b main
"${GIT[@]}" add -A
"${GIT[@]}" commit -q -m "moe_perf's reference trainer"
for ms in "${PLANTS[@]}"; do
  if [[ ${CPU:-0} == 1 ]]; then cycles=cpu; else cycles=$("$PY" "$HERE/gpu_spin_cycles.py" "$ms"); fi
  "${GIT[@]}" checkout -q -b "spin$ms" main
  "$PY" - moe_perf/trainer/train.py "$cycles" "$ms" <<'EOF'
import sys
path, cycles, ms = sys.argv[1], sys.argv[2], sys.argv[3]
src = open(path).read()
anchor = "def bench_hook() -> None:\n"
assert src.count(anchor) == 1, "train.py's bench_hook moved: update the plant"
if cycles == "cpu":
    body = f"    time.sleep({float(ms) / 1000})  # planted slowdown\n"
else:
    body = f"    torch.cuda._sleep({cycles})  # planted slowdown\n"
open(path, "w").write(src.replace(anchor, anchor + body))
EOF
  "${GIT[@]}" commit -q -am "plant: ${ms} ms GPU spin per step (${cycles} cycles)"
  echo "spin$ms: ${ms} ms = ${cycles} spin cycles per step in bench_hook" | tee -a "$OUT/bench.txt"
done
"${GIT[@]}" checkout -q main
cd "$OUT"

SHAPES=(model=qwen3-30b-a3b model.num_layers=4 mesh=single training.sequence_length=2048
        training.global_batch=32 "training.max_steps=$STEPS" "training.micro_batch=$MICRO"
        trainer.compile=true wandb.mode=disabled timeout_s=900)
[[ ${CPU:-0} == 1 ]] && SHAPES=("training.max_steps=$STEPS" wandb.mode=disabled timeout_s=300)

sweep() {  # name, feat ref, overrides...
  local name=$1 feat=$2
  shift 2
  echo "== $name: python -m moe_perf repo=<copy> refs.feat=$feat $* -m arm=base,feat" | tee -a bench.txt
  local t0=$EPOCHREALTIME
  "$PY" -m moe_perf "repo=$REPO" "${SHAPES[@]}" refs.base=main "refs.feat=$feat" "$@" \
    "hydra.sweep.dir=$OUT/$name" -m arm=base,feat 2>&1 | tee "$OUT/$name.log" || true
  "$PY" - "$OUT/$name" "$t0" "$EPOCHREALTIME" <<'PYEOF' | tee -a bench.txt
import json, pathlib, sys
wall = float(sys.argv[3]) - float(sys.argv[2])
try:
    report = json.loads((pathlib.Path(sys.argv[1]) / "comparison.json").read_text())
except OSError:
    sys.exit(print(f"no comparison after {wall:.0f} s"))
for group in report["groups"]:
    v = (group.get("verdict") or {}).get("step_time_s")
    if not v:
        print(f"{group['tag']}: no verdict ({group['status']}), {wall:.0f} s")
        continue
    ci = f"{v['low']:+.2%} to {v['high']:+.2%}" if v["low"] is not None else "none"
    print(f"{group['tag']}: {v['word']} {v['estimate']:+.2%} (CI {ci}), {v['pairs']} pairs, "
          f"{wall:.0f} s from the command to the verdict ({len(group['runs'])} arms)")
PYEOF
  cat "$OUT/$name/comparison.md" >>bench.txt 2>/dev/null || true
}

for name in ${SWEEPS:-aa ${PLANTS[*]/#/spin}}; do
  case $name in
    aa) sweep aa main ;;
    spin*) sweep "$name" "$name" ;;
    *) echo "SWEEPS: unknown sweep $name (aa, spin<ms>)" >&2; exit 2 ;;
  esac
done
