#!/usr/bin/env bash
# Builds the browser engine: web/ (nibble-web) for wasm32 with Debian's packaged Rust (rustup
# here has no wasm32 target), then wasm-bindgen --target web into web/www/pkg/ (git-ignored).
# Installs its tools first (scripts/web-tools.sh; once, outside the repository). Skips the
# build when pkg/ is newer than every source it comes from.
#
#   scripts/build-web.sh [--debug]     # build into web/www/pkg/
#   scripts/build-web.sh --clippy      # clippy -D warnings on the wasm32 build (the test command)
set -euo pipefail
cd "$(dirname "$0")/.."
profile=release
[ "${1:-}" = "--debug" ] && profile=debug
tools="${NIBBLE_TOOLS:-$HOME/.cache/nibble-tools}"
scripts/web-tools.sh
wasm_cargo() {
    # A target folder of its own: the native build uses rustup's compiler, this one Debian's.
    PATH="$tools/bin:/usr/bin:$PATH" RUSTC_BOOTSTRAP=1 \
        CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_LINKER="$tools/bin/rust-lld" \
        CARGO_TARGET_DIR=target/wasm CARGO_PROFILE_RELEASE_DEBUG=false \
        /usr/bin/cargo "$1" -p nibble-web --target wasm32-unknown-unknown -Zbuild-std=std,panic_abort \
        -j "${CARGO_BUILD_JOBS:-2}" "${@:2}"
}
if [ "${1:-}" = "--clippy" ]; then
    echo "== cargo clippy (wasm32, nibble-web)"
    wasm_cargo clippy --release -- -D warnings
    exit 0
fi
wb_version=$(sed -n 's/^wasm-bindgen = { version = "=\([0-9.]*\)".*/\1/p' web/Cargo.toml)
out=web/www/pkg
stamp="$out/.built-$profile"
if [ -f "$stamp" ] && [ -z "$(find core backend-wgpu web/src web/Cargo.toml Cargo.toml Cargo.lock -newer "$stamp" -type f 2>/dev/null | head -n 1)" ]; then
    echo "web: $out is up to date"
    exit 0
fi
echo "== building nibble-web for wasm32 ($profile; Debian's rustc $(/usr/bin/rustc --version | cut -d' ' -f2))"
flags=()
[ "$profile" = release ] && flags+=(--release)
wasm_cargo build "${flags[@]}"
rm -rf "$out"
"$tools/wasm-bindgen-$wb_version/bin/wasm-bindgen" --target web --out-dir "$out" \
    "target/wasm/wasm32-unknown-unknown/$profile/nibble_web.wasm"
touch "$stamp"
ls -la "$out"
