#!/usr/bin/env bash
# The README's first command until `nibble demo` exists. Builds nibble, then:
#  1. a real bitsandbytes checkpoint round trip: the tiny Llama that transformers saved in NF4
#     (../shared/fixtures, or the model you pass): dequantize every NF4 weight to F32, quantize
#     that back to NF4 with double quantization, inspect the result;
#  2. generation: the same tiny Llama generates 16 tokens with every layer streamed through two
#     64 KiB ring slots (the plan is printed first);
#  3. streaming: write a 512 MiB synthetic Flux-style NF4 DiT once (reused on later runs) and
#     stream all of its weights 5 times through a ring of 4 x 16 MiB, printing per-step time,
#     bytes, stall and RSS.
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
"$nibble" inspect "$out/requantized-nf4.safetensors" | tail -n 3
if [ -z "${1:-}" ]; then
    "$nibble" run --model "$model" --prompt-ids 1,2,3,4,5,6,7,8 --max-tokens 16 --backend cpu \
        --device-budget 600KiB --slots 2 --slot-size 64KiB
fi
if [ ! -f "$out/dit/config.json" ]; then
    "$nibble" synth --arch dit --size 512MiB --seed 0 -o "$out/dit"
fi
"$nibble" bench stream --model "$out/dit" --slots 4 --slot-size 16MiB --steps 5
echo "outputs in $out"
