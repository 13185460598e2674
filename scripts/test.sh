#!/usr/bin/env bash
# The whole test suite, as the README's quick start and CI run it. Installs what the tests need
# (idempotently; tools are kept outside the repository and reused), then runs every test.
set -euo pipefail
cd "$(dirname "$0")/.."

export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
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

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
echo "== cargo test"
cargo test --workspace
