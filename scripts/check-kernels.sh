#!/usr/bin/env bash
# Compiles every CUDA kernel with NVRTC 13.0 (PyPI wheels, installed once outside the repo) to
# PTX .version 9.0 for compute_90 and to an sm_90 cubin; prints registers and spills; fails on a
# compile error or a spill. No GPU needed. Skipped, with the reason, only where the wheels cannot
# be installed.
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
