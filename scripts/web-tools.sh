#!/usr/bin/env bash
# Installs what the browser build and test need, idempotently, outside the repository:
#   - Debian's packaged Rust for wasm32 (rustc-web, cargo-web, rust-web-src, rust-web-clippy; std is built from
#     source with -Zbuild-std) and lld-22 (rust-lld), since rustup here has only the native target;
#   - wasm-bindgen-cli at exactly the wasm-bindgen version the web crate pins, built once into
#     $NIBBLE_TOOLS/wasm-bindgen-<version>/ (10-16 minutes on two cores);
#   - with --browser: Debian's chromium and playwright-core (npm) in $NIBBLE_TOOLS/playwright/.
# Prints nothing but progress; exits non-zero when a tool cannot be installed.
#
#   scripts/web-tools.sh [--browser]
set -euo pipefail
cd "$(dirname "$0")/.."
tools="${NIBBLE_TOOLS:-$HOME/.cache/nibble-tools}"
wb_version=$(sed -n 's/^wasm-bindgen = { version = "=\([0-9.]*\)".*/\1/p' web/Cargo.toml)
[ -n "$wb_version" ] || { echo "error: web/Cargo.toml does not pin wasm-bindgen (=x.y.z)" >&2; exit 1; }
mkdir -p "$tools"

if [ "$(id -u)" = 0 ]; then apt_get() { apt-get "$@"; }; else apt_get() { sudo apt-get "$@"; }; fi
apt_install() {
    export DEBIAN_FRONTEND=noninteractive
    apt_get install -y --no-install-recommends "$@" >/dev/null \
        || { apt_get update -q >/dev/null && apt_get install -y --no-install-recommends "$@" >/dev/null; }
}

if [ ! -x /usr/bin/rustc ] || [ ! -x /usr/lib/llvm-22/bin/lld ] || [ ! -d /usr/lib/rustlib/src/rust/library ] \
    || [ ! -x /usr/bin/cargo-clippy ] \
    || ! /usr/bin/rustc --print target-list 2>/dev/null | grep -q '^wasm32-unknown-unknown$'; then
    echo "== installing Debian's Rust for wasm32 (rustc-web cargo-web rust-web-src rust-web-clippy lld-22)"
    apt_install rustc-web cargo-web rust-web-src rust-web-clippy lld-22
fi
# rustc links wasm32 with `rust-lld -flavor wasm`; Debian's lld-22 is that multiplexer under
# another name.
mkdir -p "$tools/bin"
if [ ! -x "$tools/bin/rust-lld" ]; then
    lld=$(command -v rust-lld || true)
    [ -n "$lld" ] || lld=/usr/lib/llvm-22/bin/lld
    [ -x "$lld" ] || { echo "error: no rust-lld and no $lld after installing lld-22" >&2; exit 1; }
    ln -sf "$lld" "$tools/bin/rust-lld"
fi

wb="$tools/wasm-bindgen-$wb_version"
if [ ! -x "$wb/bin/wasm-bindgen" ] || [ "$("$wb/bin/wasm-bindgen" --version 2>/dev/null)" != "wasm-bindgen $wb_version" ]; then
    echo "== building wasm-bindgen-cli $wb_version into $wb (once; 10-16 minutes on two cores)"
    src=$(ls -d "$HOME"/.cargo/registry/src/*/wasm-bindgen-cli-"$wb_version" 2>/dev/null | head -n 1 || true)
    if [ -z "$src" ]; then
        # `cargo install --locked` fails on this registry (its lock wants a webpki-roots release the
        # registry lacks) but leaves the crate's source unpacked, which is all we want from it.
        cargo install --locked --root "$tools/.scratch" "wasm-bindgen-cli@$wb_version" >/dev/null 2>&1 || true
        src=$(ls -d "$HOME"/.cargo/registry/src/*/wasm-bindgen-cli-"$wb_version" 2>/dev/null | head -n 1 || true)
    fi
    [ -n "$src" ] || { echo "error: could not fetch the source of wasm-bindgen-cli $wb_version from crates.io" >&2; exit 1; }
    build="$tools/wasm-bindgen-cli-src-$wb_version"
    rm -rf "$build" && cp -r "$src" "$build"
    # Pin the newest webpki-roots the registry has when the lock's is missing.
    (cd "$build" && { cargo update -q -p webpki-roots --precise 1.0.10 2>/dev/null || true; })
    CARGO_TARGET_DIR="$tools/target-wasm-bindgen" cargo install --locked --path "$build" --root "$wb" \
        -j "${CARGO_BUILD_JOBS:-2}" --bin wasm-bindgen
    rm -rf "$build" "$tools/target-wasm-bindgen" "$tools/.scratch"
fi
"$wb/bin/wasm-bindgen" --version

if [ "${1:-}" = "--browser" ]; then
    if [ ! -x /usr/bin/chromium ]; then
        echo "== installing Debian's chromium"
        apt_install chromium
    fi
    pw="$tools/playwright"
    if [ ! -f "$pw/node_modules/playwright-core/package.json" ]; then
        echo "== installing playwright-core (npm) into $pw"
        mkdir -p "$pw"
        (cd "$pw" && [ -f package.json ] || echo '{"name":"nibble-browser-test-tools","private":true}' >"$pw/package.json")
        (cd "$pw" && npm install --silent --no-audit --no-fund -E playwright-core@1.64.1 >/dev/null)
    fi
    /usr/bin/chromium --version
fi
