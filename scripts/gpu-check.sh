#!/usr/bin/env bash
# CUDA checks on a GPU machine, from release binaries built on a CPU machine and carried over.
#
#   scripts/gpu-check.sh --prepare      # here: build release binaries into gpu-bundle/ (git-ignored)
#   scripts/gpu-check.sh [OUT_DIR]      # there: run them; results under OUT_DIR (default gpu-out/)
#
# On the GPU machine it finds libcuda (the driver), and libnvrtc / libcublas from the CUDA 13
# Python wheels or toolkit present there, then runs: the conformance suite with its CUDA column
# (every op must pass against cpu_ref), the binding-split tests, and `nibble bench kernels
# --backend cuda --json`. Not covered yet (they need the model graphs and more benchmarks):
# tiny-llama / tiny-dit on CUDA, pinned-ring H2D vs cuMemcpyHtoD peak, GEMV vs device copy
# bandwidth, GEMM vs cuBLAS bf16.
set -euo pipefail
cd "$(dirname "$0")/.."
bundle=gpu-bundle
if [ "${1:-}" = "--prepare" ]; then
    cargo build --release -p nibble-cli
    out=$(cargo test --release -p nibble-tests --test conformance --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable"):
        print(m["executable"])' | tail -n 1)
    mkdir -p "$bundle"
    cp target/release/nibble "$bundle/nibble"
    cp "$out" "$bundle/conformance"
    strip "$bundle/nibble" "$bundle/conformance" 2>/dev/null || true
    ls -la "$bundle"
    exit 0
fi
out_dir="${1:-${OUT:-gpu-out}}"
mkdir -p "$out_dir"
[ -x "$bundle/nibble" ] && [ -x "$bundle/conformance" ] || { echo "error: run scripts/gpu-check.sh --prepare first (and carry $bundle)"; exit 1; }
libs=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site, sys
found = set()
for base in site.getsitepackages() + [site.getusersitepackages(), "/usr/local/cuda/lib64"]:
    for pat in ("nvidia/cu13/lib/libnvrtc.so.13*", "nvidia/cu13/lib/libcublas.so.13*", "nvidia/*/lib/libnvrtc.so.13*", "libnvrtc.so.13*"):
        for f in glob.glob(os.path.join(base, pat)):
            found.add(os.path.dirname(f))
print(":".join(sorted(found)))
PY
)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu"
inc=$(python3 -c 'import glob,site;print(next(iter(glob.glob(site.getsitepackages()[0]+"/nvidia/cu13/include")),""))' 2>/dev/null || true)
[ -n "$inc" ] && export NIBBLE_CUDA_INCLUDE="$inc"
{
    echo "== nvidia-smi"; nvidia-smi -L || true
    echo "== LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "== conformance"
    "$bundle/conformance" --nocapture --test-threads 1 every_op linear_q4_over dense_weights 2>&1 || echo "CONFORMANCE FAILED"
    echo "== bench kernels (cuda)"
    "$bundle/nibble" bench kernels --backend cuda --json > "$out_dir/bench-kernels-cuda.json" || echo "BENCH FAILED"
    cat "$out_dir/bench-kernels-cuda.json" 2>/dev/null || true
} 2>&1 | tee "$out_dir/gpu-check.log"
