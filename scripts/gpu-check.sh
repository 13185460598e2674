#!/usr/bin/env bash
# CUDA checks on a GPU machine, from release binaries built on a CPU machine and carried over.
#
#   scripts/gpu-check.sh --prepare      # here: release binaries + the fixtures they read, into
#                                       # gpu-bundle/ (git-ignored, refused over 56 MiB: carry it)
#   scripts/gpu-check.sh --preflight    # anywhere: only the preflight below
#   scripts/gpu-check.sh [OUT_DIR]      # there: the preflight, then every step; results under
#                                       # OUT_DIR (default $OUT, else gpu-out/), summary.md in it
#
# The preflight runs first and takes seconds: nvidia-smi and a GPU, the driver (libcuda.so.1)
# and its CUDA version, NVRTC 13 and cuBLAS 13 (found in the CUDA 13 Python wheels or a toolkit)
# with their versions. Anything missing ends the run at once, exit 2, one line naming it (and
# summary.md saying so): no step runs on a machine that cannot pass it.
#
# The steps, each under its own time limit (a step that overruns is killed and FAILED), with
# NIBBLE_REQUIRE_CUDA=1 (an absent CUDA is a failure, not a skip):
#   1. the conformance table's cuda column, and its wgpu column through Vulkan when the loader
#      and the driver's ICD are there (carry the loader as Debian packages in .gl/: see the device
#      tool's README); every test named with --exact and the count that passed checked;
#   2. the fixture models on CUDA: tiny-llama logits + greedy tokens, tiny-dit forward, resident
#      and with every group streamed through the pinned ring;
#   3. a SmolLM2-shaped model (synthetic weights: 576 wide, 9 / 3 heads, 49152 tokens, 30 layers;
#      the real one does not fit the 64 MiB bundle): greedy tokens on CUDA equal the CPU's up to
#      the CPU's robust prefix (steps whose top-2 margin is at least 1e-3 of the logits' range),
#      prefill and decode tok/s resident and with every layer streamed through the pinned ring;
#      transformers in bf16 on the same weights and GPU as the peer, when torch is there;
#   4. `nibble bench kernels --backend cuda --json`: pinned H2D peak vs uploads through the ring,
#      NF4 GEMV vs device copy bandwidth, NF4 GEMM vs cuBLAS bf16;
#   5. `nibble bench stream --backend cuda`: a 2 GiB synthetic model through a 4 x 64 MiB ring;
#   6. `nibble demo --backend cuda`: 20 steps with a 512 MiB device budget (per-step time, stall,
#      RSS).
# Budget: about 5 minutes on an H100 or H200 (16 cores), well inside one 10-minute call.
set -uo pipefail
cd "$(dirname "$0")/.."
bundle=gpu-bundle
max_bundle_mib=56

if [ "${1:-}" = "--prepare" ]; then
    set -e
    export CARGO_BUILD_JOBS="${CARGO_BUILD_JOBS:-2}"
    cargo build --release -p nibble-cli
    rm -rf "$bundle" && mkdir -p "$bundle"
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
    mkdir -p "$bundle/fixtures"
    for f in manifest.json format linear4bit tiny-llama-nf4 tiny-dit-nf4; do
        cp -r "../shared/fixtures/$f" "$bundle/fixtures/"
    done
    ls -la "$bundle"
    mib=$(du -sm "$bundle" | cut -f1)
    echo "bundle: $mib MiB (at most $max_bundle_mib, so that the working tree stays under 64 MiB)"
    [ "$mib" -le "$max_bundle_mib" ] || { echo "error: $bundle is $mib MiB, over $max_bundle_mib MiB" >&2; exit 1; }
    exit 0
fi

preflight_only=0
if [ "${1:-}" = "--preflight" ]; then preflight_only=1; shift; fi
out_dir="${1:-${OUT:-gpu-out}}"
mkdir -p "$out_dir"

# Where NVRTC 13 and cuBLAS 13 live: the CUDA 13 wheels (nvidia/cu13/lib) or a toolkit.
libs=$(python3 - <<'PY' 2>/dev/null || true
import glob, os, site
found = set()
bases = site.getsitepackages() + [site.getusersitepackages(), "/usr/local/cuda/lib64",
        "/usr/local/cuda/targets/x86_64-linux/lib", os.path.expanduser("~/.cache/nibble-tools/nvrtc-13.0.88")]
for base in bases:
    for pat in ("nvidia/cu13/lib/libnvrtc.so.13*", "nvidia/cu13/lib/libcublas.so.13*",
                "nvidia/*/lib/libnvrtc.so.13*", "nvidia/*/lib/libcublas.so.13*", "libnvrtc.so.13*", "libcublas.so.13*"):
        for f in glob.glob(os.path.join(base, pat)):
            found.add(os.path.dirname(f))
print(":".join(sorted(found)))
PY
)
export LD_LIBRARY_PATH="${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}:/usr/local/nvidia/lib64:/usr/lib/x86_64-linux-gnu"

# The preflight: each line "ok WHAT VERSION" or "missing WHAT: WHY"; exit 2 on any missing.
preflight() {
    local missing=()
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        missing+=("nvidia-smi (no NVIDIA driver tools on PATH)")
    elif ! gpus=$(timeout 20 nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1) \
        || [ -z "$gpus" ]; then
        missing+=("a GPU (nvidia-smi: ${gpus:-no output})")
    else
        echo "ok GPU $gpus"
    fi
    local v
    v=$(timeout 20 python3 - <<'PY' 2>&1
import ctypes, sys
def load(names):
    for n in names:
        try:
            return ctypes.CDLL(n)
        except OSError:
            pass
    return None
out = []
cuda = load(["libcuda.so.1", "libcuda.so"])
if cuda is None:
    out.append("missing libcuda.so.1: the driver library is not on the library path")
else:
    v = ctypes.c_int(0)
    r = cuda.cuDriverGetVersion(ctypes.byref(v))
    out.append(f"ok libcuda CUDA {v.value // 1000}.{v.value % 1000 // 10}" if r == 0 else f"missing libcuda: cuDriverGetVersion returned {r}")
nvrtc = load(["libnvrtc.so.13"])
if nvrtc is None:
    out.append("missing libnvrtc.so.13: install nvidia-cuda-nvrtc==13.0.* or a CUDA 13 toolkit")
else:
    a, b = ctypes.c_int(0), ctypes.c_int(0)
    nvrtc.nvrtcVersion(ctypes.byref(a), ctypes.byref(b))
    out.append(f"ok NVRTC {a.value}.{b.value}")
blas = load(["libcublas.so.13"])
if blas is None:
    out.append("missing libcublas.so.13: install nvidia-cublas (CUDA 13) or a CUDA 13 toolkit")
else:
    parts = []
    for p in (0, 1, 2):
        x = ctypes.c_int(0)
        blas.cublasGetProperty(p, ctypes.byref(x))
        parts.append(str(x.value))
    out.append("ok cuBLAS " + ".".join(parts))
print("\n".join(out))
PY
    ) || v="missing python3 ctypes probe: $v"
    while IFS= read -r line; do
        case "$line" in
            ok\ *) echo "$line" ;;
            missing\ *) missing+=("${line#missing }") ;;
            "") ;;
            *) missing+=("$line") ;;
        esac
    done <<<"$v"
    if [ ${#missing[@]} -gt 0 ]; then
        local msg
        msg=$(printf '%s; ' "${missing[@]}")
        echo "gpu-check: preflight failed, nothing else was run: ${msg%; }" >&2
        {
            echo "# gpu-check: preflight failed"
            echo
            for m in "${missing[@]}"; do echo "- missing $m"; done
        } >"$out_dir/summary.md"
        return 2
    fi
}

t0=$SECONDS
preflight | tee "$out_dir/preflight.txt"
pf=${PIPESTATUS[0]}
[ "$pf" -eq 0 ] || exit 2
echo "preflight: ok in $((SECONDS - t0)) s"
[ "$preflight_only" = 1 ] && exit 0

for b in nibble conformance llama_fixture dit_fixture; do
    [ -x "$bundle/$b" ] || { echo "error: $bundle/$b missing: run scripts/gpu-check.sh --prepare first (and carry $bundle)" >&2; exit 1; }
done
export NIBBLE_REQUIRE_CUDA=1 NIBBLE_FIXTURES="$PWD/$bundle/fixtures"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-$(mktemp -d)}"
# wgpu on the GPU through Vulkan: the loader travels as Debian packages (.gl/*.deb), the driver
# provides the ICD.
if ls .gl/*.deb >/dev/null 2>&1; then
    for f in .gl/*.deb; do dpkg -x "$f" / 2>/dev/null; done
    ldconfig 2>/dev/null || true
fi
for icd in /usr/local/nvidia/share/vulkan/icd.d/nvidia_icd.json /usr/share/vulkan/icd.d/nvidia_icd.json /etc/vulkan/icd.d/nvidia_icd.json; do
    [ -f "$icd" ] && { export VK_DRIVER_FILES="$icd"; break; }
done
if ldconfig -p 2>/dev/null | grep -q libvulkan.so.1 && [ -n "${VK_DRIVER_FILES:-}" ]; then
    export NIBBLE_REQUIRE_WGPU=1
    wgpu_note="wgpu column through Vulkan ($VK_DRIVER_FILES)"
else
    wgpu_note="no Vulkan loader or NVIDIA ICD: the wgpu column is not checked (carry .gl/ as the device README says)"
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
: >"$work/steps"
record() { echo "| $1 | $2 | $3 s |" >>"$work/steps"; echo "-- $1: $2 ($3 s)"; }
step() { # name, limit in seconds, command...
    local name=$1 limit=$2; shift 2
    echo "== $name (limit $limit s)"
    local t=$SECONDS rc=0
    timeout -k 10 "$limit" "$@" || rc=$?
    if [ $rc -eq 0 ]; then record "$name" ok $((SECONDS - t))
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then record "$name" "FAILED (over $limit s)" $((SECONDS - t))
    else record "$name" "FAILED (exit $rc)" $((SECONDS - t)); fi
}
tests() { # name, limit, binary, test names...: each run with --exact, every one must pass
    local name=$1 limit=$2 bin=$3; shift 3
    local want=$#
    echo "== $name (limit $limit s, $want tests)"
    local t=$SECONDS rc=0
    timeout -k 10 "$limit" "$bundle/$bin" --exact "$@" --nocapture --test-threads 1 >"$work/$bin.log" 2>&1 || rc=$?
    cat "$work/$bin.log"
    local passed
    passed=$(sed -n 's/^test result: .* \([0-9]*\) passed.*/\1/p' "$work/$bin.log" | tail -1)
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then record "$name" "FAILED (over $limit s)" $((SECONDS - t))
    elif [ $rc -ne 0 ]; then record "$name" "FAILED (exit $rc)" $((SECONDS - t))
    elif [ "${passed:-0}" != "$want" ]; then record "$name" "FAILED ($passed of $want tests ran)" $((SECONDS - t))
    else record "$name" "ok ($want tests)" $((SECONDS - t)); fi
}
smol() { # the SmolLM2-shaped model: CPU then CUDA, resident then streamed
    "$bundle/nibble" synth --arch llama --size 170MiB --seed 7 -o "$work/smol" >/dev/null || return 1
    grep -o '"hidden_size": *[0-9]*\|"num_hidden_layers": *[0-9]*' "$work/smol/config.json"
    local ids
    ids=$(python3 -c 'print(",".join(str((i * 7919) % 49000 + 100) for i in range(64)))')
    local common=(run --model "$work/smol" --prompt-ids "$ids" --max-tokens 64 --json)
    "$bundle/nibble" "${common[@]}" --backend cpu --logits-out "$work/smol-cpu.safetensors" >"$out_dir/smol-cpu.json" || return 1
    "$bundle/nibble" "${common[@]}" --backend cuda >"$out_dir/smol-cuda.json" || return 1
    "$bundle/nibble" "${common[@]}" --backend cuda --stream-all --slots 4 --slot-size 8MiB >"$out_dir/smol-cuda-streamed.json" || return 1
    python3 - "$work/smol-cpu.safetensors" "$out_dir" <<'PY'
import json, struct, sys
import numpy as np
path, out = sys.argv[1], sys.argv[2]
raw = open(path, "rb").read()
n = struct.unpack("<Q", raw[:8])[0]
head = json.loads(raw[8:8 + n])
t = head["step_logits"]
a, b = t["data_offsets"]
steps = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.float32).reshape(t["shape"])
top = np.sort(steps, axis=1)
margin = (top[:, -1] - top[:, -2]) / np.maximum(top[:, -1] - top[:, 0], 1e-30)
robust = int(np.argmax(margin < 1e-3)) if (margin < 1e-3).any() else len(margin)
cpu = json.load(open(f"{out}/smol-cpu.json"))["tokens"]
rows = []
ok = True
for name in ("smol-cuda", "smol-cuda-streamed"):
    got = json.load(open(f"{out}/{name}.json"))["tokens"]
    same = got[:robust] == cpu[:robust]
    ok &= same
    rows.append(f"{name}: {'equal' if same else 'DIFFERENT'} over the robust prefix of {robust} of {len(cpu)} tokens")
print("\n".join(rows))
json.dump({"robust_prefix": robust, "rows": rows}, open(f"{out}/smol-compare.json", "w"))
sys.exit(0 if ok else 1)
PY
}

{
    echo "== nvidia-smi"; nvidia-smi || true
    echo "== LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    echo "== $wgpu_note"
    tests "conformance (cuda and wgpu columns)" 240 conformance every_op_on_every_backend_matches_cpu_ref \
        attention_scores_that_overflow_are_nan_rows_on_every_backend linear_q4_over_the_binding_limit_is_split \
        dense_weights_over_the_binding_limit_are_split
    tests "tiny-llama on cuda" 120 llama_fixture tiny_llama_on_cuda
    tests "tiny-dit on cuda" 120 dit_fixture tiny_dit_forward_on_cuda
    step "SmolLM2-shaped model: cuda tokens = cpu's, tok/s" 240 smol
    if python3 -c 'import torch, transformers; assert torch.cuda.is_available()' 2>/dev/null; then
        step "transformers bf16 peer (same weights, same GPU)" 240 python3 scripts/gpu-peer.py "$bundle/nibble" "$work/smol" "$out_dir/peer.json"
    else
        record "transformers bf16 peer" "FAILED (no torch + transformers with CUDA)" 0
    fi
    step "bench kernels (cuda)" 180 sh -c "'$bundle/nibble' bench kernels --backend cuda --json > '$out_dir/bench-kernels-cuda.json'"
    step "synth 2 GiB llama" 120 "$bundle/nibble" synth --arch llama --size 2GiB -o "$work/llama2g"
    step "bench stream (cuda, pinned ring)" 120 sh -c "'$bundle/nibble' bench stream --model '$work/llama2g' --backend cuda --slots 4 --slot-size 64MiB --steps 5 --file-mode pread --json > '$out_dir/bench-stream-cuda.json'"
    step "demo (cuda, 20 steps)" 300 sh -c "'$bundle/nibble' demo --backend cuda --steps 20 --cache-dir '$work/demo-cache' --out-dir '$out_dir/demo' --json > '$out_dir/demo-cuda.json'"
} 2>&1 | tee "$out_dir/gpu-check.log"
python3 - "$out_dir" "$work/steps" <<'PY' | tee "$out_dir/summary.md"
import json, os, sys
out, steps = sys.argv[1], sys.argv[2]
print("# gpu-check\n")
print(open(os.path.join(out, "preflight.txt")).read().strip().replace("\n", "  \n"))
print("\n| check | result | time |\n|---|---|---|")
print(open(steps).read().strip() if os.path.exists(steps) else "| (no steps ran) | | |")
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except Exception as e:
        print(f"\n{name}: unreadable ({e})")
        return None
c = load("smol-compare.json")
if c:
    print("\nSmolLM2-shaped model: " + "; ".join(c["rows"]))
for name, label in (("smol-cpu.json", "cpu"), ("smol-cuda.json", "cuda resident"), ("smol-cuda-streamed.json", "cuda, every layer streamed")):
    r = load(name)
    if r:
        print(f"- {label}: prefill {r.get('prefill_tok_s', 0):.1f} tok/s, decode {r.get('decode_tok_s', 0):.1f} tok/s")
p = load("peer.json")
if p:
    print(f"- transformers {p.get('torch')} bf16 on {p.get('device')}: prefill {p['prefill_tok_s']:.1f} tok/s, decode {p['decode_tok_s']:.1f} tok/s")
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
status=0
grep -q "FAILED" "$work/steps" 2>/dev/null && status=1
[ -s "$work/steps" ] || status=1
exit $status
