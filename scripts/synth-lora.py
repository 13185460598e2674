#!/usr/bin/env python3
"""A synthetic LoRA adapter for a model nibble runs: rank R on every linear inside its blocks,
random float32 values (seeded), written as peft writes it (adapter_config.json +
adapter_model.safetensors) or, with --component transformer, as diffusers writes a Flux LoRA
(pytorch_lora_weights.safetensors, keys prefixed `transformer.`). For benchmarks of the cost of
adapters (scripts/bench-lora.sh); only the Python standard library.

    scripts/synth-lora.py MODEL_FOLDER OUT_FOLDER [--rank 16] [--seed 0] [--component transformer]
"""

import argparse
import array
import json
import os
import random
import re
import struct
import sys

BLOCK = re.compile(r"(^|\.)(layers|transformer_blocks|single_transformer_blocks|blocks)\.\d+\.")


def header(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return json.loads(f.read(n)), 8 + n


def files_of(folder):
    for idx in ("model.safetensors.index.json", "diffusion_pytorch_model.safetensors.index.json"):
        p = os.path.join(folder, idx)
        if os.path.exists(p):
            with open(p) as f:
                return sorted(set(json.load(f)["weight_map"].values()))
    for name in ("model.safetensors", "diffusion_pytorch_model.safetensors"):
        if os.path.exists(os.path.join(folder, name)):
            return [name]
    sys.exit(f"{folder}: no model.safetensors, diffusion_pytorch_model.safetensors or index")


def linears(folder):
    """(module, out, in) of every 2-D weight inside a block, 4-bit or dense."""
    out = []
    for name in files_of(folder):
        path = os.path.join(folder, name)
        h, start = header(path)
        h.pop("__metadata__", None)
        for key, t in h.items():
            if not key.endswith(".weight") or not BLOCK.search(key):
                continue
            states = [k for k in h if k.startswith(key + ".quant_state.bitsandbytes__")]
            if states:
                s = h[states[0]]
                with open(path, "rb") as f:
                    f.seek(start + s["data_offsets"][0])
                    qs = json.loads(f.read(s["data_offsets"][1] - s["data_offsets"][0]))
                shape = qs["shape"]
            elif t["dtype"] in ("F32", "F16", "BF16"):
                shape = t["shape"]
            else:
                continue
            if len(shape) == 2:
                out.append((key[: -len(".weight")], shape[0], shape[1]))
    return sorted(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("out")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--component", default=None)
    a = ap.parse_args()
    mods = linears(a.model)
    if not mods:
        sys.exit(f"{a.model}: no linear weights inside blocks")
    rng = random.Random(a.seed)
    r = a.rank
    prefix = f"{a.component}." if a.component else "base_model.model."
    tensors = []
    for m, o, i in mods:
        down = array.array("f", (rng.gauss(0.0, 1.0 / i**0.5) for _ in range(r * i)))
        up = array.array("f", (rng.gauss(0.0, 0.02) for _ in range(o * r)))
        tensors.append((f"{prefix}{m}.lora_A.weight", [r, i], down))
        tensors.append((f"{prefix}{m}.lora_B.weight", [o, r], up))
    meta = {"format": "pt"}
    config = {"r": r, "lora_alpha": r, "use_rslora": False, "peft_type": "LORA",
              "target_modules": sorted({m.rsplit(".", 1)[-1] for m, _, _ in mods}),
              "rank_pattern": {}, "alpha_pattern": {}}
    if a.component:
        meta["lora_adapter_metadata"] = json.dumps({f"{a.component}.{k}": v for k, v in config.items()})
    hdr = {"__metadata__": meta}
    off = 0
    for name, shape, data in tensors:
        n = len(data) * 4
        hdr[name] = {"dtype": "F32", "shape": shape, "data_offsets": [off, off + n]}
        off += n
    hb = json.dumps(hdr).encode()
    hb += b" " * (-len(hb) % 8)
    os.makedirs(a.out, exist_ok=True)
    fname = "pytorch_lora_weights.safetensors" if a.component else "adapter_model.safetensors"
    with open(os.path.join(a.out, fname), "wb") as f:
        f.write(struct.pack("<Q", len(hb)))
        f.write(hb)
        for _, _, data in tensors:
            if sys.byteorder != "little":
                data.byteswap()
            f.write(data.tobytes())
    if not a.component:
        with open(os.path.join(a.out, "adapter_config.json"), "w") as f:
            json.dump(config, f, indent=2)
    print(f"{a.out}: rank {r} on {len(mods)} linears, {off / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
