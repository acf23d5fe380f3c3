#!/usr/bin/env bash
# explain=true through the real command: an A/A sweep and a sweep against a branch that plants
# EXTRA grouped GEMMs (x @ w1 of every expert, the gate half of w13, results unused) in the routed experts' forward.
# The breakdown should show expert/grouped GEMM moving most, beyond its noise, and no other
# category beyond noise; the A/A none at all.
#
#   bash bench/explain_planted.sh OUT_DIR [EXTRA] [overrides ...]
#
# Defaults: one GPU, 2-layer qwen3-30b-a3b, seq 2048, global batch 8 in one micro-batch, bf16,
# 8 measured + 4 profiled steps, two interleaved repeats per arm. Later overrides win, e.g. on
# CPU: `bash bench/explain_planted.sh out 48 model=tiny dtype=fp32 training.sequence_length=64
# training.global_batch=4 training.micro_batch=1 training.max_steps=3`.
# OUT_DIR gets each sweep's directory and bench.txt with both comparisons.
set -euo pipefail

OUT=$(mkdir -p "$1" && cd "$1" && pwd)
EXTRA=${2:-2}
shift $(( $# >= 2 ? 2 : 1 ))
PY=${PYTHON:-python}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
export GIT_AUTHOR_NAME=bench GIT_AUTHOR_EMAIL=bench@moe-perf.invalid
export GIT_COMMITTER_NAME=bench GIT_COMMITTER_EMAIL=bench@moe-perf.invalid

WORK=$(mktemp -d)
REPO=$WORK/repo
mkdir -p "$REPO"
(cd "$ROOT" && git ls-files -co --exclude-standard moe_perf | grep '\.py$' | tar -cf - -T -) |
  tar -xf - -C "$REPO"
cd "$REPO"
echo "__pycache__/" > .gitignore
git init -q -b main && git add -A && git commit -q -m "moe_perf at $(git -C "$ROOT" rev-parse --short HEAD)"
git checkout -q -b more-expert-work
"$PY" - "$EXTRA" <<'EOF'
import sys
from pathlib import Path

anchor = "return expert_bmm(h_LJF, w2).view(x_ND.shape[0], -1)"
(path,) = [p for p in Path("moe_perf/trainer").glob("*.py") if anchor in p.read_text()]
lines = path.read_text().splitlines(keepends=True)
(at,) = [i for i, line in enumerate(lines) if anchor in line]
pad = lines[at][: len(lines[at]) - len(lines[at].lstrip())]
lines[at:at] = [f"{pad}for _ in range({sys.argv[1]}):  # planted\n",
                f"{pad}    expert_bmm(x_LJD, w13[..., : self.ffn])\n"]
path.write_text("".join(lines))
EOF
git commit -q -am "plant $EXTRA extra expert matmuls in the experts' forward"

SHAPES=(model=qwen3-30b-a3b model.num_layers=2 mesh=single dtype=bf16
        training.sequence_length=2048 training.global_batch=8 training.micro_batch=8
        training.max_steps=8 trainer.explain_steps=4 explain=true wandb.mode=disabled)
: > "$OUT/bench.txt"
for sweep in aa planted; do
  refs=()
  [ "$sweep" = aa ] && refs=(refs.feat=main)
  (cd "$WORK" && "$PY" -m moe_perf "repo=$REPO" "${SHAPES[@]}" "${refs[@]}" "$@" \
     "hydra.sweep.dir=$OUT/$sweep" -m repeat=0,1 arm=base,feat) | tee "$OUT/$sweep.log"
  { echo "## $sweep"; cat "$OUT/$sweep/comparison.md"; echo; } >> "$OUT/bench.txt"
done
rm -rf "$WORK"
echo "written: $OUT/bench.txt"
