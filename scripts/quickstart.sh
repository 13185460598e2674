#!/usr/bin/env bash
# The README's first command until `nibble demo` exists: build nibble, then run a real job on a
# real bitsandbytes checkpoint (the tiny Llama from ../shared/fixtures, written by transformers):
# dequantize every NF4 weight to F32, quantize that file back to NF4 with double quantization,
# and inspect the result.
set -euo pipefail
cd "$(dirname "$0")/.."
model="${1:-../shared/fixtures/tiny-llama-nf4/model}"
out="${NIBBLE_OUT:-target/quickstart}"
mkdir -p "$out"
cargo build --release -p nibble-cli
nibble=target/release/nibble
"$nibble" inspect "$model"
"$nibble" dequant "$model" --all -o "$out/dequantized.safetensors"
"$nibble" quantize "$out/dequantized.safetensors" -o "$out/requantized-nf4.safetensors" --double-quant
"$nibble" inspect "$out/requantized-nf4.safetensors"
echo "files in $out"
