#!/usr/bin/env bash
# The cost of LoRA adapters, in one run: SmolLM2-135M-Instruct in NF4 with 0, 1 and 2 synthetic
# adapters of rank 16 on every linear (scripts/synth-lora.py), prompt and decode tokens/s (64
# prompt tokens, 128 generated, median of RUNS), resident and with every layer streamed through
# an 8 MiB ring; and, with --flux FOLDER (a Flux pipeline folder, such as the one `nibble demo`
# writes under ~/.cache/nibble), seconds per denoising step after the first with 0, 1 and 2
# adapters on every linear of the transformer's blocks, in the demo's memory settings (512 MiB
# device budget, 4 x 32 MiB ring; another with --budget SIZE) and at its size. --flux-only skips
# the language model. A benchmark, not a test.
#
#   scripts/bench-lora.sh [RUNS] [--flux FOLDER [--budget SIZE] [--flux-only]]
set -euo pipefail
cd "$(dirname "$0")/.."
runs=3
flux=""
llm=1
budget=512MiB
while [ $# -gt 0 ]; do
    case "$1" in
        --flux) flux="$2"; shift 2 ;;
        --flux-only) llm=0; shift ;;
        --budget) budget="$2"; shift 2 ;;
        *) runs="$1"; shift ;;
    esac
done
cargo build --release -p nibble-cli
nibble=target/release/nibble
scripts/get-smollm2.sh "$nibble"
model=models/smollm2-135m-nf4
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 scripts/synth-lora.py "$model" "$tmp/a1" --rank 16 --seed 1
python3 scripts/synth-lora.py "$model" "$tmp/a2" --rank 16 --seed 2

median() { python3 -c 'import statistics,sys; print(round(statistics.median(float(x) for x in sys.argv[1:]), 2))' "$@"; }
field() { python3 -c 'import json,sys; print(json.loads(sys.argv[1])[sys.argv[2]])' "$1" "$2"; }
prompt=$(python3 -c 'print(",".join(str(1000 + i) for i in range(64)))')

[ "$llm" = 1 ] && echo "== SmolLM2-135M NF4, CPU backend, 64 prompt tokens, 128 decoded, median of $runs"
[ "$llm" = 1 ] && printf '%-10s %-9s %14s %14s %16s\n' adapters mode prompt_tok_s decode_tok_s bytes_per_token
for mode in $([ "$llm" = 1 ] && echo resident streamed); do
    extra=()
    [ "$mode" = streamed ] && extra=(--stream-all --slots 2 --slot-size 4MiB)
    for n in 0 1 2; do
        lora=()
        [ "$n" -ge 1 ] && lora+=(--lora "$tmp/a1")
        [ "$n" -ge 2 ] && lora+=(--lora "$tmp/a2")
        p=(); d=(); b=0
        for _ in $(seq "$runs"); do
            j=$("$nibble" run --model "$model" --backend cpu --prompt-ids "$prompt" --max-tokens 128 \
                --ignore-eos --json "${extra[@]}" "${lora[@]}" 2>/dev/null)
            p+=("$(field "$j" prefill_tok_s)"); d+=("$(field "$j" decode_tok_s)")
            b=$(python3 -c 'import json,sys; j=json.loads(sys.argv[1]); print(j["bytes_streamed"] // max(1, len(j["tokens"])))' "$j")
        done
        printf '%-10s %-9s %14s %14s %16s\n' "$n" "$mode" "$(median "${p[@]}")" "$(median "${d[@]}")" "$b"
    done
done

if [ -n "$flux" ]; then
    python3 scripts/synth-lora.py "$flux/transformer" "$tmp/f1" --rank 16 --seed 1 --component transformer
    python3 scripts/synth-lora.py "$flux/transformer" "$tmp/f2" --rank 16 --seed 2 --component transformer
    echo "== Flux pipeline $flux, CPU backend, 128x128 (the demo's size), 4 steps, device budget $budget: seconds per step after the first"
    printf '%-10s %12s %16s\n' adapters s_per_step bytes_per_step
    for n in 0 1 2; do
        lora=()
        [ "$n" -ge 1 ] && lora+=(--lora "$tmp/f1/pytorch_lora_weights.safetensors")
        [ "$n" -ge 2 ] && lora+=(--lora "$tmp/f2/pytorch_lora_weights.safetensors")
        j=$("$nibble" run --model "$flux" --backend cpu --prompt "a paper boat on a pond" --height 128 \
            --width 128 --steps 4 --max-sequence-length 64 --device-budget "$budget" --slots 4 \
            --slot-size 32MiB \
            --out "$tmp/o.png" --json "${lora[@]}" 2>"$tmp/err") || {
            printf '%-10s refused: %s\n' "$n" "$(tail -1 "$tmp/err")"
            continue
        }
        python3 -c '
import json, sys
j = json.loads(sys.argv[1]); s = j["steps"][1:]
print("%-10s %12.3f %16d" % (sys.argv[2], sum(x["wall_ms"] for x in s) / len(s) / 1e3, s[-1]["bytes_streamed"]))' "$j" "$n"
    done
fi
