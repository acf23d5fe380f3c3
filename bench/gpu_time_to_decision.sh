#!/usr/bin/env bash
# Time to a decision on one GPU (H100 or H200), every figure in one run of under 9 minutes,
# on a fresh machine (its first arm is one of the figures):
#   1. arms (bench_startup.py): the machine's first arm (compile caches and Python's bytecode
#      empty), then warm arms: their walls, step 1, the share that is not measurement;
#   2. the A/B of SWITCH (a boolean trainer switch still off by default; trainer.early_cuda_context)
#      on warm arms, off, on, on, off (one arm each);
#   3. one warm arm with sampled stacks and import times: where its seconds go
#      (bench/startup_breakdown.py);
#   4. the reference trainer's step (bench_trainer.py): bf16, fp8, fp8 with
#      trainer.fp8_master_weights, in the order bf16 fp8 fp8mw fp8mw fp8 bf16 (fp8 where torchao
#      and an fp8-capable GPU are there, else said in "Not run");
#   5. launcher.preload on sweeps of two A/A pairs (four arms each), off, on, on, off: the first
#      and the warm arms of a sweep, and the sweep's wall;
#   6. if time is left (BUDGET_S): the SWITCH A/B on cold arms (compile caches
#      empty, bytecode kept), then torchtitan's A/A sweep (bench_frameworks.sh) when TITAN_TREE
#      names a torchtitan 0.2.2 tree;
#   7. if time is left: one cold arm (compile caches empty, bytecode kept) attributed as in 3:
#      where the first arm's extra seconds go;
#   8. run right after part 1, while the machine is nearly fresh: the machine's first arm as it
#      would be with a compile cache carried from another machine of the same GPU, torch and
#      Triton: a copy of part 1's cache loaded by an arm whose bytecode directory is empty
#      (a fresh XDG_CACHE_HOME), the same with MOE_PERF_BYTECODE_POOL=arm (the bytecode pool
#      started with the arm, not with the command), then by one given a copy of part 1's
#      bytecode directory too (where the arms keep one: compile_cache.bytecode_env), each after
#      the page cache is dropped where this user may (root);
#   9. right after part 5: the runner's own imports with its bytecode kept in the machine's
#      cache or compiled anew, before a sweep's first arm (a dry run) and after its last (the
#      comparison of part 5's first sweep) (bench/bench_runner_bytecode.py).
# Shapes: 4-layer qwen3-30b-a3b, seq 2048, global batch 32, micro-batch 8, compiled, 10 steps.
#
#   bash bench/gpu_time_to_decision.sh OUT_DIR [--dry-run | --smoke]
#
# OUT_DIR (new or empty) gets summary.md, figures.json, breakdown.txt and breakdown-cold.txt
# (bench/time_to_decision_summary.py, rewritten after every part, so a run cut short keeps what
# it measured), logs.tar.gz (every part's log and records) and run.log (this script's output).
# The work (compile caches, arms) goes to WORK (default: a new temporary directory).
# --dry-run prints every part's command and runs nothing; --smoke runs the same parts at the
# tiny model's CPU shapes (the plumbing, not figures; part 5's sweeps of one pair, the page
# cache left alone, part 8's carried-arm-pool left out). Environment:
# SWITCH, PARTS (the parts after 1 to run, default "2 3 4 5 6 7 8 9"), PRELOAD_ORDER (part 5's
# sweeps, default "off on on off"), PYTHON (python3), BUDGET_S (480: an optional part starts
# only if its estimate ends before it), TITAN_TREE, WORK, COMMIT (recorded instead of the
# tree's HEAD: a copied tree's .git may be stale), SEED_CACHE (a compile cache another machine
# of the same GPU, torch and Triton filled, e.g. an earlier run's WORK/cache: copied in before
# part 1, whose first arm then loads it, bytecode still cold).
set -uo pipefail

usage() {
  echo "usage: bash bench/gpu_time_to_decision.sh OUT_DIR [--dry-run | --smoke]" >&2
  exit 2
}
[[ $# -ge 1 && $# -le 2 && $1 != -* ]] || usage
OUT=$(realpath -m "$1") MODE=${2:-gpu}
case $MODE in gpu | --dry-run | --smoke) ;; *) usage ;; esac
HERE=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
BUDGET_S=${BUDGET_S:-480}
SWITCH=${SWITCH:-trainer.early_cuda_context}
PARTS=${PARTS:-2 3 4 5 6 7 8 9}  # part 1 always runs: its arms fill the compile cache the others load
DRY=false
[[ $MODE == --dry-run ]] && DRY=true
if ! $DRY && [[ -d $OUT && -n $(ls -A "$OUT") ]]; then
  echo "gpu_time_to_decision: $OUT is not empty: give a new or empty OUT_DIR" >&2
  exit 2
fi
export PYTHONPATH="$HERE${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if [[ $MODE == --smoke ]]; then
  STARTUP=(--set model=tiny --set model.num_layers=2 --set training.sequence_length=64
           --set training.global_batch=4 --set training.micro_batch=2 --set training.max_steps=3
           --set trainer.compile=false --set training.device=cpu --set timeout_s=300)
  TRAINER=(--model tiny --layers 2 --seq 64 --global-batch 4 --micro-batch 2 --steps 3 --eager
           --device cpu --launcher python)
  FIRST_RUNS=2 WARM_ORDER=(off on) STEP_ORDER=(bf16) PRELOAD_ORDER=(off on) SWEEP_PAIRS=1
  BYTECODE_RUNS=1
  STEP_TIMEOUT=300
else
  STARTUP=(--set training.micro_batch=8 --set training.max_steps=10 --set timeout_s=240)
  TRAINER=(--layers 4 --seq 2048 --global-batch 32 --micro-batch 8 --steps 10)
  FIRST_RUNS=3 WARM_ORDER=(off on on off) STEP_ORDER=(bf16 fp8 fp8mw fp8mw fp8 bf16)
  read -ra PRELOAD_ORDER <<<"${PRELOAD_ORDER:-off on on off}"
  SWEEP_PAIRS=2 BYTECODE_RUNS=3
  STEP_TIMEOUT=300
fi
# one warm arm attributed: every thread's stack every 5 ms, the trainer's imports timed
BREAKDOWN=(--set trainer.sample_stacks_ms=5 --set 'trainer.command=[-X,importtime,-m,moe_perf.trainer]')

if $DRY; then
  WORK=${WORK:-<WORK>}
else
  WORK=${WORK:-$(mktemp -d)}
  mkdir -p "$OUT" "$WORK/logs"
  exec > >(tee "$OUT/run.log") 2>&1
fi
CACHE=$WORK/cache
declare -A USED=()  # label -> how many runs of it so far

note() {  # a part that did not run, and why (summary.md's "Not run")
  echo "not run: $*"
  $DRY || echo "$*" >>"$WORK/skipped.txt"
}

publish() {  # the figures so far into OUT
  $DRY && return 0
  "$PY" "$HERE/bench/time_to_decision_summary.py" "$WORK" "$OUT" >>"$WORK/logs/summary.log" 2>&1 ||
    echo "summary failed: see logs/summary.log"
  tar -C "$WORK" -czf "$OUT/logs.tar.gz" --exclude=cache --exclude='cache-*' --exclude='xdg-*' \
    --exclude="*.pt" --exclude=trace_rank0.json . 2>/dev/null
}

run() {  # LABEL COMMAND...: printed; unless --dry-run, run (output in logs/LABEL.log), then published
  local label=$1 rc
  shift
  echo "+ [$label] $*"
  $DRY && return 0
  local t0=$SECONDS
  timeout "$STEP_TIMEOUT" "$@" >"$WORK/logs/$label.log" 2>&1
  rc=$?
  echo "  [$label] exit $rc after $((SECONDS - t0)) s"
  ((rc == 0)) || note "$label: exit $rc (logs/$label.log)"
  publish
  return "$rc"
}

want() {  # N: whether part N is in PARTS; if not, "Not run" says so
  [[ " $PARTS " == *" $1 "* ]] && return 0
  note "part $1: not in PARTS=\"$PARTS\""
  return 1
}

fits() {  # ESTIMATE_S PART: whether an optional part's estimate ends within BUDGET_S
  $DRY && return 0
  ((SECONDS + $1 <= BUDGET_S)) && return 0
  note "$2: ${SECONDS} s gone, about $1 s more would pass BUDGET_S=$BUDGET_S"
  return 1
}

next_label() {  # VARIANT: LABEL=<variant>-<i>, the i-th run of it
  USED[$1]=$((${USED[$1]:-0} + 1))
  LABEL="$1-${USED[$1]}"
}

arm() {  # DIR LABEL [bench_startup.py args]: one arm
  local dir=$1 label=$2
  shift 2
  run "$label" "$PY" "$HERE/bench/bench_startup.py" "$WORK/$dir" --runs 1 "${STARTUP[@]}" "$@"
}

write_meta() {
  $DRY && return 0
  local commit card
  commit=${COMMIT:-$(git -C "$HERE" rev-parse HEAD 2>/dev/null || echo unknown)}
  card=$(nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null |
    head -1)
  "$PY" - "$WORK/meta.json" "$commit" "${card:-no GPU}" "$MODE" "$BUDGET_S" "$SWITCH" "$*" \
    "${SEED_CACHE:-}" <<'EOF'
import datetime, importlib.util, json, platform, sys
import torch
path, commit, card, mode, budget, switch, command, seed_cache = sys.argv[1:]
torchao = None
if importlib.util.find_spec("torchao"):
    import torchao
    torchao = torchao.__version__
json.dump({"commit": commit, "card": card, "torch": torch.__version__, "torchao": torchao,
           "python": platform.python_version(), "mode": mode, "budget_s": int(budget),
           "switch": switch, "seed_cache": seed_cache or None,
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": command}, open(path, "w"), indent=1)
EOF
}

fp8_missing() {  # why dtype=fp8 cannot run here (nothing when it can)
  "$PY" - <<'EOF'
import importlib.util, torch
if importlib.util.find_spec("torchao") is None:
    print("torchao is not installed")
elif not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9):
    print("no GPU of compute capability 8.9 or later")
EOF
}

step_variant() {  # VARIANT: one bench_trainer.py run of bf16, fp8 or fp8mw
  local variant=$1 dtype=bf16
  next_label "$variant"
  local label=$LABEL
  local extra=()
  [[ $variant == fp8* ]] && dtype=fp8
  [[ $variant == fp8mw ]] && extra=(--set trainer.fp8_master_weights=true)
  # the arms' compile cache (bf16's graphs are the arms' own) and their bytecode
  run "step-$label" env "${BYTECODE[@]}" TORCHINDUCTOR_CACHE_DIR="$CACHE/inductor" \
    TRITON_CACHE_DIR="$CACHE/triton" "$PY" "$HERE/bench/bench_trainer.py" "${TRAINER[@]}" --dtype "$dtype" "${extra[@]}" \
    --out "$WORK/trainer/$label"
}

write_meta "bash bench/gpu_time_to_decision.sh $*"
echo "== 1. arms: the machine's first, then warm (bench_startup.py)"
FIRST=()
if [[ -n ${SEED_CACHE:-} ]]; then  # the first arm loads what another machine compiled
  $DRY || { mkdir -p "$CACHE" && cp -r "$SEED_CACHE"/. "$CACHE"/; } || exit 2
  FIRST=(--warm)
fi
run startup "$PY" "$HERE/bench/bench_startup.py" "$WORK/startup" --runs "$FIRST_RUNS" \
  "${STARTUP[@]}" --cache "$CACHE" "${FIRST[@]}"

drop_page_cache() {  # before each of part 8's arms; page_cache.txt says what was done
  $DRY && return 0
  if [[ $MODE == --smoke ]]; then
    echo "kept (--smoke)" >"$WORK/page_cache.txt"
  elif sync && (echo 3 >/proc/sys/vm/drop_caches) 2>/dev/null; then
    echo "dropped" >"$WORK/page_cache.txt"
  else
    echo "kept (only root may drop it)" >"$WORK/page_cache.txt"
  fi
}

# where the arms keep Python's bytecode (compile_cache.bytecode_env; nothing where Python writes
# it beside the sources): carried by part 8, given to bench_trainer.py in part 4
mapfile -t BYTECODE < <("$PY" -c 'from moe_perf.runner.compile_cache import bytecode_env
for k, v in bytecode_env().items(): print(f"{k}={v}")')
pycache=""
for kv in "${BYTECODE[@]}"; do [[ $kv == PYTHONPYCACHEPREFIX=* ]] && pycache=${kv#*=}; done

echo "== 8. the machine's first arm with a carried compile cache (this machine made nearly new)"
if want 8; then
  if ! $DRY; then
    rm -rf "$WORK/cache-carried" "$WORK/xdg-fresh" && cp -r "$CACHE" "$WORK/cache-carried"
  fi
  drop_page_cache
  run carried "$PY" "$HERE/bench/bench_startup.py" "$WORK/carried" --runs 1 "${STARTUP[@]}" \
    --cache "$WORK/cache-carried" --warm --env "XDG_CACHE_HOME=$WORK/xdg-fresh"
  # the same with the bytecode pool started with the arm, not the command (compile_cache.POOL_SWITCH);
  # not under --smoke: the pool needs 8 cores or more, so on a small CPU host both arms are one
  if [[ $MODE == --smoke ]]; then
    note "part 8, carried-arm-pool: not under --smoke (the bytecode pool needs 8 cores or more)"
  else
    if ! $DRY; then
      rm -rf "$WORK/cache-carried3" "$WORK/xdg-fresh-pool" && cp -r "$CACHE" "$WORK/cache-carried3"
    fi
    drop_page_cache
    run carried-arm-pool "$PY" "$HERE/bench/bench_startup.py" "$WORK/carried-arm-pool" --runs 1 \
      "${STARTUP[@]}" --cache "$WORK/cache-carried3" --warm --env "XDG_CACHE_HOME=$WORK/xdg-fresh-pool" \
      --env MOE_PERF_BYTECODE_POOL=arm
  fi
  if [[ -z $pycache ]]; then
    note "part 8, bytecode carried: the arms keep no bytecode directory here (Python writes it beside the sources)"
  else
    if ! $DRY; then
      rm -rf "$WORK/cache-carried2" "$WORK/xdg-carried" && cp -r "$CACHE" "$WORK/cache-carried2" &&
        mkdir -p "$WORK/xdg-carried/moe_perf" && cp -r "$pycache" "$WORK/xdg-carried/moe_perf/pycache"
    fi
    drop_page_cache
    run carried-bytecode "$PY" "$HERE/bench/bench_startup.py" "$WORK/carried-bytecode" --runs 1 \
      "${STARTUP[@]}" --cache "$WORK/cache-carried2" --warm --env "XDG_CACHE_HOME=$WORK/xdg-carried"
  fi
fi

echo "== 2. $SWITCH on warm arms: ${WARM_ORDER[*]}"
want 2 && for switch in "${WARM_ORDER[@]}"; do
  next_label "$switch"
  value=false
  [[ $switch == on ]] && value=true
  arm "warmup/$LABEL" "warmup-$LABEL" --cache "$CACHE" --warm --set "$SWITCH=$value"
done

echo "== 3. one warm arm attributed (bench/startup_breakdown.py)"
want 3 && run breakdown "$PY" "$HERE/bench/bench_startup.py" "$WORK/breakdown" --runs 1 "${STARTUP[@]}" \
  --cache "$CACHE" --warm "${BREAKDOWN[@]}"

echo "== 4. the step (bench_trainer.py): ${STEP_ORDER[*]}"
missing=""
$DRY || missing=$(fp8_missing)
want 4 || STEP_ORDER=()
for variant in "${STEP_ORDER[@]}"; do
  if [[ $variant == fp8* && -n $missing ]]; then
    note "step $variant: dtype=fp8: $missing"
    continue
  fi
  step_variant "$variant"
done

echo "== 5. launcher.preload on sweeps of $SWEEP_PAIRS A/A pairs: ${PRELOAD_ORDER[*]}"
want 5 && for switch in "${PRELOAD_ORDER[@]}"; do
  next_label "sweep-$switch"
  value=false
  [[ $switch == on ]] && value=true
  run "$LABEL" "$PY" "$HERE/bench/bench_startup.py" "$WORK/preload/$switch-${LABEL##*-}" --runs 1 \
    --pairs "$SWEEP_PAIRS" "${STARTUP[@]}" --cache "$CACHE" --warm --set "launcher.preload=$value"
done

echo "== 9. the runner's own imports, its bytecode kept or compiled anew"
if want 9; then
  sweep=""  # part 5's first sweep, compared again; else the bench makes one of its own
  for dir in "$WORK"/preload/*/run1; do [[ -d $dir ]] && sweep=$dir && break; done
  run runner-bytecode "$PY" "$HERE/bench/bench_runner_bytecode.py" "$WORK/runner-bytecode" \
    --runs "$BYTECODE_RUNS" ${sweep:+--sweep "$sweep"}
fi

echo "== 6. if time is left: $SWITCH on cold arms; torchtitan"
if [[ $MODE != --smoke ]] && want 6; then
  for switch in off on; do
    fits 45 "cold arm, $SWITCH $switch" || break
    value=false
    [[ $switch == on ]] && value=true
    arm "cold/$switch-1" "cold-$switch" --cache "$WORK/cache-cold-$switch" \
      --set "$SWITCH=$value"
  done
  if [[ -n ${TITAN_TREE:-} && -d ${TITAN_TREE:-} ]]; then
    fits 100 "torchtitan A/A" &&
      run titan env MICRO=8 STEPS=10 SWEEPS=titan_aa PYTHON="$PY" \
        bash "$HERE/bench/bench_frameworks.sh" "$TITAN_TREE" "$WORK/titan"
  else
    note "torchtitan: TITAN_TREE does not name a torchtitan tree"
  fi
fi
echo "== 7. if time is left: one cold arm attributed (bench/startup_breakdown.py)"
if [[ $MODE != --smoke ]] && want 7 && fits 40 "cold arm attributed"; then
  run breakdown-cold "$PY" "$HERE/bench/bench_startup.py" "$WORK/breakdown-cold" --runs 1 \
    "${STARTUP[@]}" --cache "$WORK/cache-breakdown-cold" "${BREAKDOWN[@]}"
fi
publish
$DRY || cat "$OUT/summary.md"
echo "== done in ${SECONDS} s; work in $WORK"
