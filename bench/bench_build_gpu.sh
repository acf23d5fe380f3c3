#!/usr/bin/env bash
# trainer.build on one GPU: a torchtitan checkout whose MoE gathers its routed tokens through a
# CUDA extension of the repository (torch.utils.cpp_extension), built in each commit's worktree.
#
#   bash bench/bench_build_gpu.sh TITAN_TREE OUT_DIR [REPEATS]
#
# TITAN_TREE: a torchtitan 0.2.2 source tree (torchtitan/ and tests/assets/tokenizer/), copied
# into a fresh git repository. Branch `main` adds `moe_permute_ext` (permute.cu: one block per
# routed row copies it from x; the launch repeated REPEATS_BASE=1 time) and gathers MoE.forward's
# routed input through it (an autograd Function, index_add_ for the gradient). Branch `slower`
# repeats the launch REPEATS (default 8) times: the same result, more GPU time per gather.
# Sweep `build` (-m repeat=0,1 arm=base,feat, trainer.build in place, build cache in OUT_DIR)
# builds each commit once and measures it; sweep `cached` (-m arm=base,feat) finds both builds
# in the cache (SWEEPS, default "build cached"; PAIRS, default 0,1, the build sweep's repeats;
# MICRO, default 4; LAYERS, default 2). bench.txt in OUT_DIR collects: per arm the build's
# status, whether it was reused or restored, its time, the extension file and hash it loaded, the step time; then the
# comparisons. Needs nvcc (CUDA_HOME or PATH) and setuptools for the arms' python.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)  # bench/, before any cd

TREE=$(cd "$1" && pwd)
OUT=$(mkdir -p "$2" && cd "$2" && pwd)
REPEATS=${3:-8}
PY=${PYTHON:-python}
STEPS=${STEPS:-8}
# Eager torchtitan (the extension is opaque to dynamo) at 4 layers ran out of memory on an 80 GB
# H100 at micro-batch 8 and at 4 (fp32 weights, gradients and Adam states of 3B parameters,
# 48 GB, before activations): 2 layers by default.
LAYERS=${LAYERS:-2}
MICRO=${MICRO:-4}  # micro-batch / torchtitan's local batch
PAIRS=${PAIRS:-0,1}  # the build sweep's repeats
SWEEPS=${SWEEPS:-build cached}

command -v nvcc >/dev/null || [ -x "${CUDA_HOME:-/usr/local/cuda}/bin/nvcc" ] || {
  echo "nvcc not found: set CUDA_HOME or put the CUDA toolkit's bin on PATH" >&2; exit 2; }
export CUDA_HOME=${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")}
"$PY" -c "import setuptools, torch.utils.cpp_extension" || exit 2
# one architecture, this GPU's: a build of minutes instead of one per architecture torch knows
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")}

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
REPO=$WORK/torchtitan
PYTHON=$PY bash "$HERE/make_titan_repo.sh" "$TREE" "$REPO"  # one commit on main: the tree
mkdir -p "$REPO/moe_permute"
cat > "$REPO/moe_permute/permute.cu" <<'EOF'
// Routed-row gather for the MoE: out[r] = x[rows[r]], one block per row.
#include <ATen/cuda/CUDAContext.h>
#include <torch/extension.h>

#ifndef LAUNCHES
#define LAUNCHES 1
#endif

template <typename T>
__global__ void gather_rows(const T* __restrict__ x, const int64_t* __restrict__ rows,
                            T* __restrict__ out, int64_t dim) {
  const T* src = x + rows[blockIdx.x] * dim;
  T* dst = out + static_cast<int64_t>(blockIdx.x) * dim;
  for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) dst[c] = src[c];
}

torch::Tensor gather(torch::Tensor x, torch::Tensor rows) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && rows.scalar_type() == torch::kInt64);
  auto out = torch::empty({rows.size(0), x.size(1)}, x.options());
  if (rows.size(0) == 0) return out;
  auto stream = at::cuda::getCurrentCUDAStream();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "gather_rows", [&] {
    for (int i = 0; i < LAUNCHES; ++i)  // the slower branch repeats the same copy
      gather_rows<scalar_t><<<rows.size(0), 256, 0, stream>>>(
          x.data_ptr<scalar_t>(), rows.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), x.size(1));
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("gather", &gather); }
EOF
cat > "$REPO/setup_permute.py" <<'EOF'
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

setup(name="moe_permute_ext",
      ext_modules=[CUDAExtension("moe_permute_ext", ["moe_permute/permute.cu"])],
      cmdclass={"build_ext": BuildExtension})
EOF
cat > "$REPO/torchtitan/models/moe/permute_ext.py" <<'EOF'
"""MoE.forward's routed-row gather through the repository's CUDA extension."""
import torch

import moe_permute_ext  # built in the checkout: python setup_permute.py build_ext --inplace


class GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        ctx.num_rows = x.shape[0]
        return moe_permute_ext.gather(x.contiguous(), rows.contiguous())

    @staticmethod
    def backward(ctx, grad):
        (rows,) = ctx.saved_tensors
        grad_x = grad.new_zeros((ctx.num_rows, grad.shape[1]))
        return grad_x.index_add_(0, rows, grad), None
EOF
"$PY" - torchtitan/models/moe/moe.py "$REPO" <<'EOF'
import pathlib, sys
path = pathlib.Path(sys.argv[2], sys.argv[1])
src = path.read_text()
anchor = "        routed_input = x[token_indices_experts_sorted // self.router.top_k]\n"
assert src.count(anchor) == 1, "MoE.forward's gather moved: update the bench"
use = ("        routed_input = GatherRows.apply(x, token_indices_experts_sorted // self.router.top_k)\n")
src = src.replace(anchor, use)
imports = "from torchtitan.tools.logging import logger\n"
assert src.count(imports) == 1, "moe.py's imports moved: update the bench"
src = src.replace(imports, imports + "from torchtitan.models.moe.permute_ext import GatherRows\n")
path.write_text(src)
EOF
printf 'build/\n*.so\n__pycache__/\n' >> "$REPO/.gitignore"
cd "$REPO"
GIT=(git -c user.name=bench -c user.email=bench@moe-perf.invalid)
git add -A
"${GIT[@]}" commit -q -m "MoE gather through moe_permute_ext"
git checkout -q -b slower
sed -i "s/#define LAUNCHES 1/#define LAUNCHES $REPEATS/" moe_permute/permute.cu
"${GIT[@]}" commit -q -am "moe_permute_ext: the gather launched $REPEATS times"
git checkout -q main
echo "base: one gather launch per MoE layer and micro-batch; feat: $REPEATS (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)" | tee "$OUT/bench.txt"

ARGS=(trainer=torchtitan model=qwen3-30b-a3b "model.num_layers=$LAYERS" mesh=single
      training.sequence_length=2048 training.global_batch=32 "training.max_steps=$STEPS"
      "training.micro_batch=$MICRO" trainer.compile=false wandb.mode=disabled timeout_s=900
      refs.base=main refs.feat=slower
      'trainer.build=["{python}",setup_permute.py,build_ext,--inplace]'
      'trainer.verify_imports=[moe_permute_ext]' "trainer.build_cache=$OUT/build-cache")

sweep() {  # name, overrides...
  local name=$1; shift
  echo "== $name: python -m moe_perf ${ARGS[*]} $*" | tee -a "$OUT/bench.txt"
  local t0=$EPOCHREALTIME
  "$PY" -m moe_perf "${ARGS[@]}" "hydra.sweep.dir=$OUT/$name" "$@" 2>&1 | tee "$OUT/$name.log" || true
  "$PY" - "$OUT/$name" "$t0" "$EPOCHREALTIME" <<'PYEOF' | tee -a "$OUT/bench.txt"
import json, pathlib, sys
wall = float(sys.argv[3]) - float(sys.argv[2])
print(f"sweep wall {wall:.1f} s")
recs = sorted((json.loads(p.read_text()) for p in pathlib.Path(sys.argv[1]).glob("*/*/metrics.json")),
              key=lambda r: r["started"])
for r in recs:
    b = r.get("build") or {}
    how = "restored from the cache" if (b.get("cache") or {}).get("hit") else (
        f"reused ({b.get('built_by')}'s)" if b.get("reused") else "built")
    ext = next((e for e in r.get("imports", []) if e["module"] == "moe_permute_ext"), {})
    step = r["summary"].get("step_time_s")
    print(f"{r['arm']}-r{r['repeat']} {r['sha'][:10]}: {r['status']}, build {b.get('status')} {how}, "
          f"{b.get('wall_s')} s here (build {b.get('build_wall_s')} s); loads {ext.get('file')} "
          f"sha256 {str(ext.get('sha256'))[:12]}; median step {step} s" + (f"; {r['failure']}" if r["failure"] else ""))
PYEOF
  cat "$OUT/$name/comparison.md" >> "$OUT/bench.txt" 2>/dev/null || echo "(no comparison)" >> "$OUT/bench.txt"
}

for name in $SWEEPS; do
  case $name in
    build) sweep build -m "repeat=$PAIRS" arm=base,feat ;;
    cached) sweep cached -m arm=base,feat ;;
    *) echo "SWEEPS: unknown sweep $name (build cached)" >&2; exit 2 ;;
  esac
done
