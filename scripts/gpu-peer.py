"""The transformers peer of scripts/gpu-check.sh: the same synthetic Llama folder nibble ran,
its 4-bit weights dequantized by `nibble dequant` (bitsandbytes' values exactly) and the rest as
stored, in bf16 on the same GPU; prefill and decode tokens/s for the same 64-token prompt and 64
greedy tokens (the KV cache on, as in nibble).

    python3 scripts/gpu-peer.py NIBBLE MODEL_DIR OUT_JSON
"""

import json
import os
import subprocess
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM

nibble, model_dir, out = sys.argv[1:4]
tmp = tempfile.mkdtemp()
dense = os.path.join(tmp, "dense.safetensors")
subprocess.run([nibble, "dequant", model_dir, "--all", "-o", dense], check=True,
               stdout=subprocess.DEVNULL)

stored = load_file(os.path.join(model_dir, "model.safetensors"))
state = {
    k: v for k, v in stored.items()
    if v.dtype != torch.uint8 and not any(
        s in k for s in (".absmax", ".quant_map", ".nested_", ".quant_state"))
}
state.update(load_file(dense))
state = {k: v.to(torch.bfloat16) for k, v in state.items()}

cfg = json.load(open(os.path.join(model_dir, "config.json")))
cfg.pop("quantization_config", None)
config = LlamaConfig(**cfg)
with torch.device("cuda"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
missing, unexpected = model.load_state_dict(state, strict=False)
if unexpected or [m for m in missing if "rotary" not in m]:
    sys.exit(f"weights do not fit the model: missing {missing}, unexpected {unexpected}")
model.eval()

ids = torch.tensor([[(i * 7919) % 49000 + 100 for i in range(64)]], device="cuda")
new = 64


def timed(f, runs=3):
    best = float("inf")
    for _ in range(runs):
        torch.cuda.synchronize()
        t = time.perf_counter()
        f()
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t)
    return best


with torch.no_grad():
    model(ids)  # warm-up: kernels loaded, cuBLAS initialized
    prefill = timed(lambda: model(ids))
    whole = timed(lambda: model.generate(ids, max_new_tokens=new, min_new_tokens=new,
                                         do_sample=False, pad_token_id=0))
result = {
    "torch": torch.__version__,
    "device": torch.cuda.get_device_name(0),
    "prefill_tok_s": ids.shape[1] / prefill,
    "decode_tok_s": new / max(whole - prefill, 1e-9),
}
json.dump(result, open(out, "w"))
print(json.dumps(result))
