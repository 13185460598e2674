#!/usr/bin/env bash
# nibble against stable-diffusion.cpp on the same machine, in one run: the same Flux-shaped
# transformer (width 3072, 24 heads of 128, FLUX.1-dev's embedders, DOUBLE double-stream and
# SINGLE single-stream blocks instead of 19 and 38 so that it fits here) and FLUX.1's VAE
# decoder, drawn once as float16 (scripts/synth-flux-race.py) and given to each engine in its
# own layout: stable-diffusion.cpp (stable-diffusion-cpp-python 0.4.7, built from source with
# -march=native into the tools folder) loads the BFL-named file and converts it to q4_0 as it
# loads (--type q4_0), with its flash attention on (--diffusion-fa, its faster setting here);
# nibble runs `nibble quantize` (NF4, blocks of 64) on the diffusers-named copy inside a
# diffusers Flux pipeline folder. Same image size, the same 256 text tokens, the
# same sampler (Euler, flow matching), the same threads; seconds per denoising step (median of
# the steps of every run) and the VAE decode's seconds, and the ratios. The text encoders are
# not timed (stable-diffusion.cpp gets a CLIP-L and no T5, whose zero states it pads to 256
# tokens; nibble gets the demo's small CLIP and T5 and --max-sequence-length 256).
# A benchmark, not a test: it prints a table and the ratios.
#
#   scripts/bench-vs-sdcpp.sh [RUNS] [SIZE] [STEPS] [DOUBLE] [SINGLE]    (3 256 4 2 4)
set -euo pipefail
cd "$(dirname "$0")/.."
runs="${1:-3}"; size="${2:-256}"; steps="${3:-4}"; double="${4:-2}"; single="${5:-4}"
threads=2
tools="${NIBBLE_TOOLS:-$HOME/.cache/nibble-tools}"
venv="$tools/sdcpp-venv"
data="$tools/flux-race-d${double}-s${single}-seed0-v1"
version=0.4.7
# -march=native: a build is this CPU's; another CPU model rebuilds it.
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2- | tr -s ' ')
stamp="$venv/.nibble-sdcpp-$version"

if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$cpu" ]; then
    echo "== building stable-diffusion-cpp-python $version from source into $venv (minutes)"
    python3 -m venv "$venv"
    "$venv/bin/pip" install -q --upgrade pip
    "$venv/bin/pip" install -q numpy
    CMAKE_BUILD_PARALLEL_LEVEL=$threads "$venv/bin/pip" install -q --force-reinstall --no-cache-dir \
        --no-binary stable-diffusion-cpp-python "stable-diffusion-cpp-python==$version"
    echo "$cpu" > "$stamp"
fi
py="$venv/bin/python"

cargo build --release -p nibble-cli
nibble=target/release/nibble

if [ ! -f "$data/.complete" ]; then
    echo "== drawing the float16 weights into $data"
    rm -rf "$data"
    "$py" scripts/synth-flux-race.py "$data" --double "$double" --single "$single" > "$data.json"
    echo "== nibble: NF4 transformer inside a Flux pipeline folder"
    "$nibble" synth --arch flux --size 180MiB --out "$data/nibble" 2>&1 | tail -1
    rm -rf "$data/nibble/transformer" "$data/nibble/vae"
    mkdir -p "$data/nibble/transformer"
    "$nibble" quantize "$data/transformer-f16" --blocksize 64 \
        -o "$data/nibble/transformer/diffusion_pytorch_model.safetensors" 2>&1 | tail -1
    "$py" - "$data" <<'PY'
import json, sys
d = sys.argv[1]
c = json.load(open(f"{d}/transformer-f16/config.json"))
c["quantization_config"] = {
    "_load_in_4bit": True, "_load_in_8bit": False, "bnb_4bit_compute_dtype": "bfloat16",
    "bnb_4bit_quant_storage": "uint8", "bnb_4bit_quant_type": "nf4",
    "bnb_4bit_use_double_quant": False, "load_in_4bit": True, "load_in_8bit": False,
    "quant_method": "bitsandbytes"}
json.dump(c, open(f"{d}/nibble/transformer/config.json", "w"), indent=2)
PY
    cp -r "$data/vae" "$data/nibble/vae"
    rm -rf "$data/transformer-f16"   # nibble's copy is quantized; sd.cpp keeps its own
    mv "$data.json" "$data/shapes.json"
    touch "$data/.complete"
fi

echo "== what each engine is given"
"$py" - "$data" <<'PY'
import json, os, sys
d = sys.argv[1]
s = json.load(open(f"{d}/shapes.json"))
mib = lambda p: f"{os.path.getsize(p) / 2**20:.1f} MiB"
print(f"transformer: width 3072, 24 heads x 128, {s['double_blocks']} double + {s['single_blocks']} "
      f"single blocks, {s['transformer_params'] / 1e9:.3f} G parameters (float16 once drawn); "
      f"VAE decoder {s['vae_decoder_params'] / 1e6:.1f} M parameters (FLUX.1's shapes)")
print(f"stable-diffusion.cpp: {d}/sdcpp/flux.safetensors ({mib(d + '/sdcpp/flux.safetensors')}, "
      f"float16, converted to q4_0 as it loads), ae.safetensors ({mib(d + '/sdcpp/ae.safetensors')}, "
      f"float16), clip_l.safetensors (CLIP-L, not timed)")
print(f"nibble: {d}/nibble (diffusers FluxPipeline folder): transformer NF4 "
      f"({mib(d + '/nibble/transformer/diffusion_pytorch_model.safetensors')}), vae float16 "
      f"({mib(d + '/nibble/vae/diffusion_pytorch_model.safetensors')}), the demo's CLIP and T5 (not timed)")
PY
echo "image ${size}x${size} ($(( (size / 16) * (size / 16) )) image tokens), 256 text tokens, $steps Euler steps, $threads threads, $runs runs each"

log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT
echo "== stable-diffusion.cpp"
sd_json=()
for r in $(seq "$runs"); do
    "$py" scripts/sdcpp-bench.py "$data/sdcpp" "$size" "$steps" "$threads" q4_0 \
        > "$log/sd$r.json" 2> "$log/sd$r.log" || { tail -20 "$log/sd$r.log"; exit 1; }
    grep -a -E "Version:|flux: depth|params backend buffer size|decode_first_stage completed|sampling completed" \
        "$log/sd$r.log" | sed 's/^/    /' | { [ "$r" = 1 ] && cat || grep -a completed; }
    sd_json+=("$log/sd$r")
done
echo "== nibble"
for r in $(seq "$runs"); do
    NIBBLE_THREADS=$threads "$nibble" run --model "$data/nibble" --prompt "a lighthouse on a cliff at dusk" \
        --height "$size" --width "$size" --steps "$steps" --max-sequence-length 256 --guidance 3.5 \
        --seed 0 --backend cpu --out "$log/nibble$r.png" --json > "$log/nib$r.json" 2> "$log/nib$r.log" \
        || { tail -20 "$log/nib$r.log"; exit 1; }
done

"$py" - "$log" "$runs" "$steps" "$size" <<'PY'
import json, re, statistics, sys
log, runs, steps, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
sd_steps, sd_vae, nb_steps, nb_vae = [], [], [], []
for r in range(1, runs + 1):
    j = json.loads(open(f"{log}/sd{r}.json").read().strip().splitlines()[-1])
    sd_steps += j["step_s"][-steps:]
    m = re.findall(r"decode_first_stage completed, taking ([0-9.]+)s", open(f"{log}/sd{r}.log", errors="replace").read())
    sd_vae.append(float(m[-1]))
    n = json.load(open(f"{log}/nib{r}.json"))
    nb_steps += [s["wall_ms"] / 1000 for s in n["steps"]]
    nb_vae.append(next(p["ms"] for p in n["phases"] if p["phase"] == "VAE") / 1000)
    backend = n["backend"]
med = statistics.median
ss, sv, ns, nv = med(sd_steps), med(sd_vae), med(nb_steps), med(nb_vae)
print(f"\nFlux-shaped transformer, {size}x{size}, 256 text tokens, {steps} steps, median over {runs} runs\n")
print("| engine | weights | s / denoising step | VAE decode s |")
print("|---|---|---|---|")
print(f"| stable-diffusion.cpp 0.4.7 (python binding, built from source; flash attention) | q4_0 | {ss:.2f} | {sv:.2f} |")
print(f"| nibble ({backend}) | NF4 | {ns:.2f} | {nv:.2f} |")
print(f"\nnibble / stable-diffusion.cpp: denoising step {ss / ns:.2f}x (target >= 1.5x), VAE decode {sv / nv:.2f}x")
PY
