#!/usr/bin/env bash
# A git repository (branch main, one commit) holding a torchtitan source tree and seeded
# synthetic data for its c4_test loader, for the benches that run trainer=torchtitan.
#
#   bash bench/make_titan_repo.sh TITAN_TREE DEST
#
# TITAN_TREE: a torchtitan 0.2.2 source tree (torchtitan/ and tests/assets/tokenizer/), copied
# to DEST; its c4_test loader then reads 2000 seeded JSON lines from tests/assets/c4_test.
set -euo pipefail
PY=${PYTHON:-python}
cp -r "$1" "$2"
mkdir -p "$2/tests/assets/c4_test"
"$PY" - "$2/tests/assets/c4_test/data.json" <<'PYEOF'
import json, random, sys
words = ("the of and to in is was for on that with as by at from his her an which are this "
         "be or had it not were but have their they one all been has more when who its also "
         "first new would two after some time into other than may over them only these year").split()
rng = random.Random(1234)
with open(sys.argv[1], "w") as f:
    for _ in range(2000):
        f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(600))}) + "\n")
PYEOF
cd "$2"
git init -q -b main
git add -A
git -c user.name=bench -c user.email=bench@moe-perf.invalid commit -q -m "torchtitan tree"
