#!/usr/bin/env bash
# Beyond RAM: a synthetic NF4 model about 1.5x this machine's RAM (MemTotal), a Llama decoder and
# then a Flux-style DiT (one at a time: the disk needs room for one), read with `auto` budgets and
# --file-mode pread-dropcache (every read dropped from the page cache after use). Before each run
# the files are dropped from the page cache and read once with a cold `dd` for the disk's
# throughput. Prints per-step time, bytes read per step, peak RSS against the plan's prediction,
# the streaming throughput against the cold dd, and the step time against max(read time at the
# dd's speed, compute time). A benchmark, not a test: it needs free disk
# (the model's size plus 2 GiB).
#
#   scripts/bench-beyond-ram.sh [SIZE]   SIZE defaults to 1.5x MemTotal (e.g. 36GiB); a smaller
#                                         SIZE runs the same measurement on a model that fits RAM
#   NIBBLE_HOST_BUDGET=4GiB ...          a host budget instead of `auto` (a machine with that much
#                                         available memory, where the model is beyond it)
#   NIBBLE_BENCH_SLOTS=16 NIBBLE_BENCH_SLOT_SIZE=32MiB
#                                         the staging ring (default 16 x 32 MiB = 512 MiB: reads run
#                                         ahead through a few layers' compute; `auto` for both
#                                         gives the CLI's own choice, a ring that holds the
#                                         largest streamed group, at most 1 GiB)
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p nibble-cli
nibble="$PWD/target/release/nibble"
ram=$(awk '/MemTotal/ {printf "%.0f", $2 * 1024}' /proc/meminfo)
size="${1:-$((ram * 3 / 2))}"
size_bytes=$(python3 -c "
import re, sys
s = sys.argv[1]
m = re.fullmatch(r'(\d+(?:\.\d+)?)\s*([KMGT]i?B)?', s)
mult = {None: 1, 'KiB': 1 << 10, 'MiB': 1 << 20, 'GiB': 1 << 30, 'TiB': 1 << 40, 'KB': 1e3, 'MB': 1e6, 'GB': 1e9, 'TB': 1e12}
print(int(float(m.group(1)) * mult[m.group(2)]))" "$size")
work="${NIBBLE_BENCH_DIR:-$PWD/target/beyond-ram}"
mkdir -p "$work"
free=$(df --output=avail -B1 "$work" | tail -1)
echo "RAM $(numfmt --to=iec "$ram"), model size $(numfmt --to=iec "$size_bytes") ($(python3 -c "print(f'{$size_bytes / $ram:.2f}')")x RAM), free disk in $work: $(numfmt --to=iec "$free")"
if [ "$free" -lt $((size_bytes + (2 << 30))) ]; then
    echo "error: not enough free disk for a $(numfmt --to=iec "$size_bytes") model: give a smaller SIZE or NIBBLE_BENCH_DIR on a larger disk" >&2
    exit 2
fi

drop() { python3 - "$@" <<'PY'
import os, sys
for root in sys.argv[1:]:
    for d, _, fs in os.walk(root):
        for f in fs:
            fd = os.open(os.path.join(d, f), os.O_RDONLY)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(fd)
PY
}

results="$work/results.jsonl"
: > "$results"
for arch in llama dit; do
    dir="$work/$arch"
    rm -rf "$dir"
    echo "== synthesizing a $(numfmt --to=iec "$size_bytes") NF4 $arch in $dir"
    "$nibble" synth --arch "$arch" --size "$size_bytes" --out "$dir" >/dev/null
    sync
    drop "$dir"
    bytes=$(du -sb "$dir" | cut -f1)
    t0=$(date +%s.%N)
    for f in "$dir"/*.safetensors; do dd if="$f" of=/dev/null bs=16M status=none; done
    t1=$(date +%s.%N)
    dd_mib_s=$(python3 -c "print($bytes / ($t1 - $t0) / 2**20)")
    echo "  cold dd: $(numfmt --to=iec "$bytes") at $(printf %.0f "$dd_mib_s") MiB/s"
    if [ "$arch" = llama ]; then
        runs=("llama|--prompt-ids 1,2,3,4 --max-tokens 4 --ignore-eos")
    else
        # One token of image and one of text: the step is bound by the reads. Then the CLI's
        # default sizes (16 image, 8 text tokens), where a machine with few cores computes
        # longer than its disk reads: that step is measured against max(read, compute).
        runs=("dit 1+1 tokens|--steps 3 --height 1 --width 1 --text-len 1"
              "dit 16+8 tokens|--steps 3")
    fi
    for r in "${runs[@]}"; do
        label="${r%%|*}"
        read -r -a args <<< "${r#*|}"
        drop "$dir"
        "$nibble" run --model "$dir" --file-mode pread-dropcache --host-budget "${NIBBLE_HOST_BUDGET:-auto}" \
            --slots "${NIBBLE_BENCH_SLOTS:-16}" --slot-size "${NIBBLE_BENCH_SLOT_SIZE:-32MiB}" \
            --json "${args[@]}" > "$work/run.json"
        python3 - "$label" "$work/run.json" "$dd_mib_s" "$bytes" >> "$results" <<'PY'
import json, sys
arch, path, dd, size = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
v = json.load(open(path))
s = v.get("summary", v)
plan, budget = s["plan"], s["budget"]
device = plan["peak_device_bytes"] if plan["device_in_host_memory"] else 0
predicted = budget["rss_at_plan_bytes"] + plan["peak_host_bytes"] + device
src = s["bytes_source_per_step"]
if arch == "llama":
    peak = v["rss_max_bytes"]
    step_s = 1 / v["decode_tok_s"] if v["decode_tok_s"] > 0 else float("nan")
    stall_s = float("nan")
else:
    later_steps = v["steps"][1:] or v["steps"]
    peak = s["rss_max_bytes"]
    step_s = sum(r["wall_ms"] for r in later_steps) / 1e3 / len(later_steps)
    stall_s = sum(r["stall_ms"] for r in later_steps) / 1e3 / len(later_steps)
later = src[1:] or src
per_step = sum(later) / len(later)
# The step's own work: its time less the time it waited for reads.
compute_s = step_s - stall_s
bound_s = max(per_step / 2**20 / dd, compute_s) if compute_s == compute_s else float("nan")
print(json.dumps({"arch": arch, "model_bytes": size, "step_s": step_s, "source_bytes_per_step": per_step,
                  "compute_s": compute_s, "step_over_bound": step_s / bound_s,
                  "stream_mib_s": per_step / step_s / 2**20, "dd_mib_s": dd,
                  "ratio_to_dd": per_step / step_s / 2**20 / dd, "peak_rss": peak,
                  "predicted_peak_rss": predicted, "within_plan": peak <= predicted + (16 << 20),
                  "device_budget": budget["device_budget_bytes"], "host_budget": budget["host_budget_bytes"]}))
PY
        tail -1 "$results"
    done
    rm -rf "$dir"
done
python3 - "$results" "$ram" <<'PY'
import json, sys
ram = int(sys.argv[2])
# A decoded token's stall is not reported: no compute time, no bound.
num = lambda x: "-" if x != x else f"{x:.2f}"
print("\n| run | size (x RAM) | s per step | read per step | stream MiB/s | cold dd MiB/s | x dd "
      "| compute s | step / max(read at dd, compute) | peak RSS | plan's peak |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for l in open(sys.argv[1]):
    r = json.loads(l)
    g = lambda b: f"{b / 2**30:.2f} GiB"
    print(f"| {r['arch']} | {g(r['model_bytes'])} ({r['model_bytes'] / ram:.2f}x) | {r['step_s']:.2f} | "
          f"{g(r['source_bytes_per_step'])} | {r['stream_mib_s']:.0f} | {r['dd_mib_s']:.0f} | "
          f"{r['ratio_to_dd']:.2f} | {num(r['compute_s'])} | {num(r['step_over_bound'])} | "
          f"{r['peak_rss'] / 2**20:.0f} MiB | {r['predicted_peak_rss'] / 2**20:.0f} MiB |")
PY
