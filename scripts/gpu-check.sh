#!/usr/bin/env bash
# CUDA checks on a GPU machine, from release binaries built on a CPU machine and carried over.
#
#   scripts/gpu-check.sh --prepare      # here: release binaries + the fixtures they read, into
#                                       # gpu-bundle/ (git-ignored; about 40 MiB, carry it)
#   scripts/gpu-check.sh [OUT_DIR]      # there: run them; results under OUT_DIR (default $OUT,
#                                       # else gpu-out/), a summary in OUT_DIR/summary.md
#
# On the GPU machine it finds libcuda (the driver) and libnvrtc / libcublas from the CUDA 13
# Python wheels or toolkit present there, then, with NIBBLE_REQUIRE_CUDA=1 (an absent CUDA is a
# failure, not a skip):
#   1. the conformance suite with its CUDA column: every op against cpu_ref;
#   2. the fixture models on CUDA: tiny-llama logits + 16 greedy tokens, tiny-dit forward, both
#      resident and with every group streamed through the pinned ring;
#   3. `nibble bench kernels --backend cuda --json`: kernels plus the references the targets are
#      measured against (pinned cuMemcpyHtoD peak vs uploads through the ring, NF4 GEMV GB/s vs
#      device-to-device copy bandwidth, NF4 GEMM vs cuBLAS bf16 on the same shape);
#   4. `nibble bench stream --backend cuda`: a 2 GiB synthetic model read from the page cache
#      and uploaded through a pinned 4 x 64 MiB ring;
#   5. `nibble demo --backend cuda`: the text encoder then the 1.5 GiB DiT, streamed for 20 steps
#      with a 512 MiB device budget, per-step time and RSS.
# Budget: about 4 minutes on an H200 (16 cores) including the demo model's first write.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=gpu-bundle
if [ "${1:-}" = "--prepare" ]; then
    set -e
    export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
    cargo build --release -p nibble-cli
    mkdir -p "$bundle"
    cargo test --release -p nibble-tests --test conformance --test llama_fixture --test dit_fixture \
        --no-run --message-format=json 2>/dev/null \
        | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["kind"] == ["test"]:
        print(m["target"]["name"], m["executable"])' \
        | while read -r name exe; do cp "$exe" "$bundle/$name"; done
    cp target/release/nibble "$bundle/nibble"
    strip "$bundle"/* 2>/dev/null || true
    # The fixtures the tests read (../shared does not travel with the working tree).
    rm -rf "$bundle/fixtures" && mkdir -p "$bundle/fixtures"
    for f in manifest.json format linear4bit tiny-llama-nf4 tiny-dit-nf4; do
        cp -r "../shared/fixtures/$f" "$bundle/fixtures/"
    done
    du -sh "$bundle"
    ls -la "$bundle"
    exit 0
fi
out_dir="${1:-${OUT:-gpu-out}}"
mkdir -p "$out_dir"
for b in nibble conformance llama_fixture dit_fixture; do
    [ -x "$bundle/$b" ] || { echo "error: $bundle/$b missing: run scripts/gpu-check.sh --prepare first (and carry $bundle)"; exit 1; }
done
libs=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
found = set()
bases = site.getsitepackages() + [site.getusersitepackages(), "/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
for base in bases:
    for pat in ("nvidia/cu13/lib/libnvrtc.so.13*", "nvidia/cu13/lib/libcublas.so.13*",
                "nvidia/*/lib/libnvrtc.so.13*", "nvidia/*/lib/libcublas.so.13*", "libnvrtc.so.13*", "libcublas.so.13*"):
        for f in glob.glob(os.path.join(base, pat)):
            found.add(os.path.dirname(f))
print(":".join(sorted(found)))
PY
)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu"
inc=$(python3 -c 'import glob,site
for b in site.getsitepackages():
    for d in glob.glob(b + "/nvidia/cu13/include"):
        print(d); raise SystemExit' 2>/dev/null || true)
[ -z "$inc" ] && [ -f /usr/local/cuda/include/cuda_bf16.h ] && inc=/usr/local/cuda/include
[ -n "$inc" ] && export NIBBLE_CUDA_INCLUDE="$inc"
export NIBBLE_REQUIRE_CUDA=1 NIBBLE_FIXTURES="$PWD/$bundle/fixtures"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
: >"$work/steps"
step() { # name, command...
    local name=$1; shift
    echo "== $name"
    local t0=$SECONDS
    if "$@"; then echo "-- $name: ok ($((SECONDS - t0)) s)"; echo "| $name | ok | $((SECONDS - t0)) s |" >>"$work/steps"
    else echo "-- $name: FAILED ($((SECONDS - t0)) s)"; echo "| $name | FAILED | $((SECONDS - t0)) s |" >>"$work/steps"; fi
}
{
    echo "== nvidia-smi"; nvidia-smi -L || true
    echo "== LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "== NIBBLE_CUDA_INCLUDE=${NIBBLE_CUDA_INCLUDE:-}"
    step "conformance (cuda column)" "$bundle/conformance" --nocapture --test-threads 1
    step "tiny-llama on cuda" "$bundle/llama_fixture" --nocapture tiny_llama_on_cuda
    step "tiny-dit on cuda" "$bundle/dit_fixture" --nocapture tiny_dit_forward_on_cuda
    step "bench kernels (cuda)" sh -c "'$bundle/nibble' bench kernels --backend cuda --json > '$out_dir/bench-kernels-cuda.json'"
    step "synth 2 GiB llama" "$bundle/nibble" synth --arch llama --size 2GiB -o "$work/llama2g"
    step "bench stream (cuda, pinned ring)" sh -c "'$bundle/nibble' bench stream --model '$work/llama2g' --backend cuda --slots 4 --slot-size 64MiB --steps 5 --file-mode pread --json > '$out_dir/bench-stream-cuda.json'"
    step "demo (cuda, 20 steps)" sh -c "'$bundle/nibble' demo --backend cuda --steps 20 --cache-dir '$work/demo-cache' --out-dir '$out_dir/demo' --json > '$out_dir/demo-cuda.json'"
} 2>&1 | tee "$out_dir/gpu-check.log"
python3 - "$out_dir" "$work/steps" <<'PY' | tee "$out_dir/summary.md"
import json, os, sys
out, steps = sys.argv[1], sys.argv[2]
print("| check | result | time |\n|---|---|---|")
print(open(steps).read().strip() if os.path.exists(steps) else "| (no steps ran) | | |")
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as e:
        print(f"\n{name}: unreadable ({e})")
        return None
k = load("bench-kernels-cuda.json")
if k:
    print(f"\n{k['backend']}\n\n| kernel | ms/call | GB/s | GFLOP/s |\n|---|---|---|---|")
    for r in k["kernels"]:
        print(f"| {r['kernel']} | {r['ms_per_call']:.3f} | {r['gb_s']:.1f} | {r['gflop_s']:.1f} |")
    print(f"\nreferences: {json.dumps(k.get('references'))}\nratios (targets: ring H2D >= 0.9, GEMV >= 0.8, GEMM >= 0.7): {json.dumps(k.get('ratios'))}")
s = load("bench-stream-cuda.json")
if s:
    m = s["summary"]
    print(f"\nbench stream to cuda (2 GiB, pinned 4 x 64 MiB ring): {m['throughput_mib_s']:.0f} MiB/s vs sequential read {m['baseline_mib_s']:.0f} MiB/s, RSS max {m['rss_max_bytes']/2**20:.1f} MiB")
d = load("demo-cuda.json")
if d:
    print("\ndemo on cuda: " + json.dumps(d.get("summary", {k: v for k, v in d.items() if k != "steps"}))[:2000])
PY
# The steps ran in the pipeline's subshell: their results are in the steps file.
grep -q "FAILED" "$work/steps" 2>/dev/null && status=1
[ -s "$work/steps" ] || status=1
exit $status
