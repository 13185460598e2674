#!/usr/bin/env bash
# The browser test: builds the wasm engine if needed (scripts/build-web.sh), installs Chromium
# and playwright-core once (scripts/web-tools.sh --browser), serves web/www with the shared
# fixtures mounted at /fixtures/ (`nibble serve`), and runs web/tests/browser.mjs in headless
# Chromium on WebGPU (SwiftShader). Results, the report and screenshots: target/browser-test/.
#
#   scripts/test-browser.sh [NIBBLE_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
tools="${NIBBLE_TOOLS:-$HOME/.cache/nibble-tools}"
nibble="${1:-}"
if [ -z "$nibble" ]; then
    cargo build -p nibble-cli
    nibble=target/debug/nibble
fi
[ -f ../shared/fixtures/manifest.json ] || { echo "error: ../shared/fixtures is missing" >&2; exit 1; }
scripts/web-tools.sh --browser
scripts/build-web.sh
out=target/browser-test
mkdir -p "$out"
PLAYWRIGHT_DIR="$tools/playwright/node_modules" timeout 900 \
    node web/tests/browser.mjs "$nibble" ../shared/fixtures "$out"
