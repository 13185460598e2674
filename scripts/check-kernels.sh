#!/usr/bin/env bash
# Compiles every CUDA kernel with NVRTC 13.0 (PyPI wheels, installed once outside the repo) to
# PTX .version 9.0 for compute_90 and to an sm_90 cubin; prints registers and spills; fails on a
# compile error or a spill. No GPU needed. Skipped, with the reason, only where the wheels cannot
# be installed. Then runs the attention kernels and the 4-bit GEMV on the CPU through
# scripts/cuda-emu (below).
set -euo pipefail
cd "$(dirname "$0")/.."
tools="${NIBBLE_TOOLS:-$HOME/.cache/nibble-tools}"
nv="$tools/nvrtc-13.0.88"
if [ ! -f "$nv/.installed" ]; then
    echo "installing NVRTC 13.0 wheels into $nv"
    mkdir -p "$tools"
    if ! python3 -m pip install --quiet --no-deps --target "$nv" \
        nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-runtime==13.0.96; then
        echo "SKIPPED: could not install nvidia-cuda-nvrtc==13.0.88 / nvidia-cuda-runtime==13.0.96 with pip"
        exit 0
    fi
    touch "$nv/.installed"
fi
export LD_LIBRARY_PATH="$nv/nvidia/cu13/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
python3 scripts/check_kernels.py "$nv" backend-cuda/kernels
# The attention kernels' tiling, shuffles and barriers run on the CPU (scripts/cuda-emu) against
# attention in double: their logic checked where there is no GPU.
if ! command -v g++ >/dev/null 2>&1; then
    echo "installing g++ (the CUDA emulation check)"
    if [ "$(id -u)" = 0 ]; then apt_get() { apt-get "$@"; }; else apt_get() { sudo apt-get "$@"; }; fi
    DEBIAN_FRONTEND=noninteractive apt_get install -y --no-install-recommends g++ \
        || { apt_get update && DEBIAN_FRONTEND=noninteractive apt_get install -y --no-install-recommends g++; }
fi
emu=$(mktemp -d)
trap 'rm -rf "$emu"' EXIT
g++ -std=c++20 -O1 -pthread -w scripts/cuda-emu/attention.cpp -o "$emu/attention"
"$emu/attention"
# The 4-bit GEMV (linear_q4.cu): its staging of x, chunks, both weight paths and reduction,
# against the product in double.
g++ -std=c++20 -O1 -pthread -w scripts/cuda-emu/linear_q4.cpp -o "$emu/linear_q4"
"$emu/linear_q4"
