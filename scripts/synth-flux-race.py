#!/usr/bin/env python3
"""The race against stable-diffusion.cpp: one set of random float16 weights of a Flux-shaped
transformer (width 3072, 24 heads of 128, FLUX.1-dev's embedders, a reduced number of double
and single blocks) and of FLUX.1's VAE decoder, written twice with the same values:

  OUT/sdcpp/flux.safetensors        BFL names (double_blocks.N.img_attn.qkv, ...), as
                                    stable-diffusion.cpp loads a --diffusion-model
  OUT/sdcpp/ae.safetensors          the VAE decoder in the original (LDM) names
  OUT/sdcpp/clip_l.safetensors      a CLIP ViT-L/14 text model (stable-diffusion.cpp's Flux
                                    conditioner needs one to give the transformer its 256 text
                                    tokens; it is not timed)
  OUT/transformer-f16/              diffusers' FluxTransformer2DModel names and config.json
                                    (the fused qkv / linear1 split as diffusers' converter
                                    splits them, the final norm's shift and scale swapped)
  OUT/vae/                          diffusers' AutoencoderKL decoder names and FLUX.1's config

Weights are uniform in +-1/sqrt(fan_in) (torch's default Linear init), norms 1, so that the
activations stay finite through every block. Only numpy is needed.

  synth-flux-race.py OUT [--double N] [--single N] [--seed S]
"""
import argparse
import json
import os

import numpy as np

HIDDEN, HEADS, HEAD_DIM = 3072, 24, 128
MLP = 4 * HIDDEN
IN_CH, JOINT, POOLED, TIME_DIM = 64, 4096, 768, 256


class Writer:
    """A safetensors file written tensor by tensor (header first: every shape is known)."""

    def __init__(self, path, entries):
        self.path = path
        self.entries = entries  # [(name, shape)]
        header, off = {}, 0
        for name, shape in entries:
            n = int(np.prod(shape)) * 2
            header[name] = {"dtype": "F16", "shape": list(shape), "data_offsets": [off, off + n]}
            off += n
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        self.f = open(path + ".tmp", "wb")
        self.f.write(len(blob).to_bytes(8, "little") + blob)
        self.order = [n for n, _ in entries]
        self.next = 0

    def put(self, name, arr):
        assert self.order[self.next] == name, (self.order[self.next], name)
        shape = dict(self.entries)[name]
        assert tuple(arr.shape) == tuple(shape), (name, arr.shape, shape)
        self.f.write(np.ascontiguousarray(arr, dtype=np.float16).tobytes())
        self.next += 1

    def close(self):
        assert self.next == len(self.order)
        self.f.close()
        os.replace(self.path + ".tmp", self.path)


def flux_tensors(n_double, n_single):
    """(BFL name, shape, fan_in) in BFL order; fan_in 0 marks a norm scale (ones)."""
    t = []

    def lin(name, out, inp, bias=True):
        t.append((name + ".weight", (out, inp), inp))
        if bias:
            t.append((name + ".bias", (out,), inp))

    lin("img_in", HIDDEN, IN_CH)
    lin("time_in.in_layer", HIDDEN, TIME_DIM)
    lin("time_in.out_layer", HIDDEN, HIDDEN)
    lin("vector_in.in_layer", HIDDEN, POOLED)
    lin("vector_in.out_layer", HIDDEN, HIDDEN)
    lin("guidance_in.in_layer", HIDDEN, TIME_DIM)
    lin("guidance_in.out_layer", HIDDEN, HIDDEN)
    lin("txt_in", HIDDEN, JOINT)
    for b in range(n_double):
        for s in ("img", "txt"):
            p = f"double_blocks.{b}.{s}"
            lin(f"{p}_mod.lin", 6 * HIDDEN, HIDDEN)
            lin(f"{p}_attn.qkv", 3 * HIDDEN, HIDDEN)
            t.append((f"{p}_attn.norm.query_norm.scale", (HEAD_DIM,), 0))
            t.append((f"{p}_attn.norm.key_norm.scale", (HEAD_DIM,), 0))
            lin(f"{p}_attn.proj", HIDDEN, HIDDEN)
            lin(f"{p}_mlp.0", MLP, HIDDEN)
            lin(f"{p}_mlp.2", HIDDEN, MLP)
    for b in range(n_single):
        p = f"single_blocks.{b}"
        lin(f"{p}.linear1", 3 * HIDDEN + MLP, HIDDEN)
        lin(f"{p}.linear2", HIDDEN, HIDDEN + MLP)
        t.append((f"{p}.norm.query_norm.scale", (HEAD_DIM,), 0))
        t.append((f"{p}.norm.key_norm.scale", (HEAD_DIM,), 0))
        lin(f"{p}.modulation.lin", 3 * HIDDEN, HIDDEN)
    lin("final_layer.adaLN_modulation.1", 2 * HIDDEN, HIDDEN)
    lin("final_layer.linear", IN_CH, HIDDEN)
    return t


def to_diffusers(name, arr):
    """The diffusers tensors one BFL tensor becomes: [(name, array)]."""
    rename = {
        "img_in": "x_embedder",
        "time_in.in_layer": "time_text_embed.timestep_embedder.linear_1",
        "time_in.out_layer": "time_text_embed.timestep_embedder.linear_2",
        "vector_in.in_layer": "time_text_embed.text_embedder.linear_1",
        "vector_in.out_layer": "time_text_embed.text_embedder.linear_2",
        "guidance_in.in_layer": "time_text_embed.guidance_embedder.linear_1",
        "guidance_in.out_layer": "time_text_embed.guidance_embedder.linear_2",
        "txt_in": "context_embedder",
        "final_layer.linear": "proj_out",
    }
    base, _, leaf = name.rpartition(".")
    if base in rename:
        return [(f"{rename[base]}.{leaf}", arr)]
    if base == "final_layer.adaLN_modulation.1":
        shift, scale = np.split(arr, 2, axis=0)
        return [(f"norm_out.linear.{leaf}", np.concatenate([scale, shift], axis=0))]
    parts = name.split(".")
    if parts[0] == "double_blocks":
        b, rest = parts[1], ".".join(parts[2:])
        p = f"transformer_blocks.{b}"
        for s, ctx in (("img", ""), ("txt", "_context")):
            added = "" if s == "img" else "add_"
            if rest.startswith(f"{s}_mod.lin."):
                return [(f"{p}.norm1{ctx}.linear.{leaf}", arr)]
            if rest.startswith(f"{s}_attn.qkv."):
                q, k, v = np.split(arr, 3, axis=0)
                if s == "img":
                    names = ("to_q", "to_k", "to_v")
                else:
                    names = ("add_q_proj", "add_k_proj", "add_v_proj")
                return [(f"{p}.attn.{n}.{leaf}", x) for n, x in zip(names, (q, k, v))]
            if rest == f"{s}_attn.norm.query_norm.scale":
                return [(f"{p}.attn.norm_{'added_' if added else ''}q.weight", arr)]
            if rest == f"{s}_attn.norm.key_norm.scale":
                return [(f"{p}.attn.norm_{'added_' if added else ''}k.weight", arr)]
            if rest.startswith(f"{s}_attn.proj."):
                out = "to_out.0" if s == "img" else "to_add_out"
                return [(f"{p}.attn.{out}.{leaf}", arr)]
            if rest.startswith(f"{s}_mlp.0."):
                return [(f"{p}.ff{ctx}.net.0.proj.{leaf}", arr)]
            if rest.startswith(f"{s}_mlp.2."):
                return [(f"{p}.ff{ctx}.net.2.{leaf}", arr)]
    if parts[0] == "single_blocks":
        b, rest = parts[1], ".".join(parts[2:])
        p = f"single_transformer_blocks.{b}"
        if rest.startswith("linear1."):
            q, k, v, mlp = np.split(arr, [HIDDEN, 2 * HIDDEN, 3 * HIDDEN], axis=0)
            return [(f"{p}.{n}.{leaf}", x) for n, x in
                    zip(("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"), (q, k, v, mlp))]
        if rest.startswith("linear2."):
            return [(f"{p}.proj_out.{leaf}", arr)]
        if rest == "norm.query_norm.scale":
            return [(f"{p}.attn.norm_q.weight", arr)]
        if rest == "norm.key_norm.scale":
            return [(f"{p}.attn.norm_k.weight", arr)]
        if rest.startswith("modulation.lin."):
            return [(f"{p}.norm.linear.{leaf}", arr)]
    raise SystemExit(f"no diffusers name for {name}")


def draw(rng, shape, fan_in):
    if fan_in == 0:
        return np.ones(shape, np.float16)
    bound = 1.0 / np.sqrt(fan_in)
    return rng.uniform(-bound, bound, size=shape).astype(np.float16)


def write_pair(rng, bfl_path, diff_path, tensors, convert):
    """Draws each tensor once and writes it under both names."""
    diff_entries = []
    for name, shape, _ in tensors:
        for n, a in convert(name, np.zeros(shape, np.float16)):
            diff_entries.append((n, a.shape))
    wb = Writer(bfl_path, [(n, s) for n, s, _ in tensors])
    wd = Writer(diff_path, diff_entries)
    pending = {}
    for name, shape, fan_in in tensors:
        a = draw(rng, shape, fan_in)
        wb.put(name, a)
        for n, x in convert(name, a):
            pending[n] = x
        # diffusers order differs from BFL order only inside a tensor's own split.
        while wd.next < len(wd.order) and wd.order[wd.next] in pending:
            n = wd.order[wd.next]
            wd.put(n, pending.pop(n))
    wb.close()
    wd.close()


def vae_tensors():
    """FLUX.1's AutoencoderKL decoder, (LDM name, shape, fan_in), and its diffusers name."""
    ch = [128, 256, 512, 512]
    t = []

    def conv(ldm, diff, out, inp, k):
        t.append((f"{ldm}.weight", (out, inp, k, k), inp * k * k, f"{diff}.weight"))
        t.append((f"{ldm}.bias", (out,), inp * k * k, f"{diff}.bias"))

    def norm(ldm, diff, c):
        t.append((f"{ldm}.weight", (c,), 0, f"{diff}.weight"))
        t.append((f"{ldm}.bias", (c,), -1, f"{diff}.bias"))

    def resnet(ldm, diff, inp, out):
        norm(f"{ldm}.norm1", f"{diff}.norm1", inp)
        conv(f"{ldm}.conv1", f"{diff}.conv1", out, inp, 3)
        norm(f"{ldm}.norm2", f"{diff}.norm2", out)
        conv(f"{ldm}.conv2", f"{diff}.conv2", out, out, 3)
        if inp != out:
            conv(f"{ldm}.nin_shortcut", f"{diff}.conv_shortcut", out, inp, 1)

    top = ch[-1]
    conv("decoder.conv_in", "decoder.conv_in", top, 16, 3)
    resnet("decoder.mid.block_1", "decoder.mid_block.resnets.0", top, top)
    norm("decoder.mid.attn_1.norm", "decoder.mid_block.attentions.0.group_norm", top)
    for ldm, diff in (("q", "to_q"), ("k", "to_k"), ("v", "to_v"), ("proj_out", "to_out.0")):
        conv(f"decoder.mid.attn_1.{ldm}", f"decoder.mid_block.attentions.0.{diff}", top, top, 1)
    resnet("decoder.mid.block_2", "decoder.mid_block.resnets.1", top, top)
    inp = top
    for i, out in enumerate(reversed(ch)):
        level = len(ch) - 1 - i
        for j in range(3):
            resnet(f"decoder.up.{level}.block.{j}", f"decoder.up_blocks.{i}.resnets.{j}", inp, out)
            inp = out
        if level > 0:
            conv(f"decoder.up.{level}.upsample.conv", f"decoder.up_blocks.{i}.upsamplers.0.conv",
                 out, out, 3)
    norm("decoder.norm_out", "decoder.conv_norm_out", ch[0])
    conv("decoder.conv_out", "decoder.conv_out", 3, ch[0], 3)
    return t


def clip_tensors():
    """CLIP ViT-L/14's text model in transformers' names."""
    d, ff, layers = 768, 3072, 12
    t = [("text_model.embeddings.token_embedding.weight", (49408, d), 1),
         ("text_model.embeddings.position_embedding.weight", (77, d), 1)]
    for i in range(layers):
        p = f"text_model.encoder.layers.{i}"
        for n in ("k_proj", "v_proj", "q_proj", "out_proj"):
            t += [(f"{p}.self_attn.{n}.weight", (d, d), d), (f"{p}.self_attn.{n}.bias", (d,), d)]
        t += [(f"{p}.layer_norm1.weight", (d,), 0), (f"{p}.layer_norm1.bias", (d,), -1)]
        t += [(f"{p}.mlp.fc1.weight", (ff, d), d), (f"{p}.mlp.fc1.bias", (ff,), d)]
        t += [(f"{p}.mlp.fc2.weight", (d, ff), ff), (f"{p}.mlp.fc2.bias", (d,), ff)]
        t += [(f"{p}.layer_norm2.weight", (d,), 0), (f"{p}.layer_norm2.bias", (d,), -1)]
    t += [("text_model.final_layer_norm.weight", (d,), 0),
          ("text_model.final_layer_norm.bias", (d,), -1)]
    return t


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--double", type=int, default=2)
    ap.add_argument("--single", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)

    def drawn(shape, fan_in):
        # -1 marks a norm bias (zeros), 0 a norm scale (ones).
        return np.zeros(shape, np.float16) if fan_in < 0 else draw(rng, shape, fan_in)

    tensors = flux_tensors(a.double, a.single)
    write_pair(rng, f"{a.out}/sdcpp/flux.safetensors",
               f"{a.out}/transformer-f16/diffusion_pytorch_model.safetensors", tensors,
               to_diffusers)
    with open(f"{a.out}/transformer-f16/config.json", "w") as f:
        json.dump({
            "_class_name": "FluxTransformer2DModel", "_diffusers_version": "0.32.0",
            "attention_head_dim": HEAD_DIM, "axes_dims_rope": [16, 56, 56],
            "guidance_embeds": True, "in_channels": IN_CH, "joint_attention_dim": JOINT,
            "num_attention_heads": HEADS, "num_layers": a.double,
            "num_single_layers": a.single, "out_channels": None, "patch_size": 1,
            "pooled_projection_dim": POOLED,
        }, f, indent=2)

    vt = vae_tensors()
    wl = Writer(f"{a.out}/sdcpp/ae.safetensors", [(n, s) for n, s, _, _ in vt])
    wd = Writer(f"{a.out}/vae/diffusion_pytorch_model.safetensors",
                [(d, s if not d.startswith("decoder.mid_block.attentions.0.to_") else s[:2])
                 for _, s, _, d in vt])
    for ldm, shape, fan_in, diff in vt:
        x = drawn(shape, fan_in)
        wl.put(ldm, x)
        wd.put(diff, x.reshape(shape[:2]) if diff.startswith(
            "decoder.mid_block.attentions.0.to_") else x)
    wl.close()
    wd.close()
    with open(f"{a.out}/vae/config.json", "w") as f:
        json.dump({
            "_class_name": "AutoencoderKL", "_diffusers_version": "0.32.0",
            "act_fn": "silu", "block_out_channels": [128, 256, 512, 512],
            "down_block_types": ["DownEncoderBlock2D"] * 4, "force_upcast": True,
            "in_channels": 3, "latent_channels": 16, "latents_mean": None,
            "latents_std": None, "layers_per_block": 2, "mid_block_add_attention": True,
            "norm_num_groups": 32, "out_channels": 3, "sample_size": 1024,
            "scaling_factor": 0.3611, "shift_factor": 0.1159,
            "up_block_types": ["UpDecoderBlock2D"] * 4, "use_post_quant_conv": False,
            "use_quant_conv": False,
        }, f, indent=2)

    ct = clip_tensors()
    wc = Writer(f"{a.out}/sdcpp/clip_l.safetensors", [(n, s) for n, s, _ in ct])
    for n, s, fan_in in ct:
        wc.put(n, drawn(s, fan_in))
    wc.close()
    print(json.dumps({"double_blocks": a.double, "single_blocks": a.single,
                      "transformer_params": sum(int(np.prod(s)) for _, s, _ in tensors),
                      "vae_decoder_params": sum(int(np.prod(s)) for _, s, _, _ in vt)}))


if __name__ == "__main__":
    main()
