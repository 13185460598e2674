#!/usr/bin/env python3
"""stable-diffusion.cpp's side of scripts/bench-vs-sdcpp.sh: loads the race's BFL-named Flux
transformer (converted to WTYPE as it loads), the LDM-named VAE and a CLIP-L, makes one image
and prints one JSON line: seconds per denoising step (from the library's own progress
callback), the VAE decode's seconds (from its log line, which stderr carries; the caller
parses it) and what it was given.

  sdcpp-bench.py DIR SIZE STEPS THREADS [WTYPE]
"""
import json
import sys
import time

from stable_diffusion_cpp import StableDiffusion


def main():
    d, size, steps, threads = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    wtype = sys.argv[5] if len(sys.argv) > 5 else "q4_0"
    t0 = time.time()
    sd = StableDiffusion(
        diffusion_model_path=f"{d}/flux.safetensors",
        clip_l_path=f"{d}/clip_l.safetensors",
        vae_path=f"{d}/ae.safetensors",
        vae_decode_only=True,
        n_threads=threads,
        wtype=wtype,
        verbose=True,
        # Its faster attention on CPU too (~3% a step at 256 x 256 here).
        diffusion_flash_attn=True,
    )
    load_s = time.time() - t0
    step_s = []

    def progress(step, total, secs):
        if total == steps:
            step_s.append(secs)

    t0 = time.time()
    images = sd.generate_image(
        prompt="a lighthouse on a cliff at dusk",
        width=size,
        height=size,
        sample_steps=steps,
        cfg_scale=1.0,
        guidance=3.5,
        seed=0,
        sample_method="euler",
        progress_callback=progress,
    )
    total_s = time.time() - t0
    print(json.dumps({
        "engine": "stable-diffusion.cpp (stable-diffusion-cpp-python 0.4.7)",
        "wtype": wtype, "threads": threads, "width": size, "height": size,
        "steps": steps, "sampler": "euler", "text_tokens": 256, "diffusion_flash_attn": True,
        "step_s": step_s, "load_s": load_s, "generate_s": total_s,
        "image": list(images[0].size),
    }), flush=True)


if __name__ == "__main__":
    main()
