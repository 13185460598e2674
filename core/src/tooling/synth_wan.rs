//! A synthetic diffusers Wan 2.1 pipeline folder (`WanPipeline`): the files of the
//! `Wan-AI/Wan2.1-T2V-*-Diffusers` repos that nibble reads, in the layouts diffusers and
//! transformers write them, with deterministic random weights: `model_index.json`, the
//! UniPC scheduler config, a umT5 unigram `tokenizer.json`, a bitsandbytes NF4 umT5 encoder
//! (`wo` dense, as transformers keeps it), an NF4 `WanTransformer3DModel` (every Linear
//! quantized as diffusers does; the time embedder, norms and modulation tables dense) and the
//! `AutoencoderKLWan` decoder (the encoder, which text to video never runs, left out).
//!
//! [`WanSynthShape::real_1_3b`] and [`WanSynthShape::real_14b`] are the real repos' shapes and
//! configs; [`WanSynthShape::scaled`] sizes the transformer to a byte count. Random weights give
//! a noise video: the point is the memory and streaming behaviour of the real pipeline.

use std::path::Path;

use serde_json::json;

use super::synth::{quantization_config, Kind, SynthModel};
use super::synth_flux::{linear, norm, t5, t5_tokenizer_json, write_json, write_t5_tokenizer};
use crate::error::Result;

/// The shapes of a synthetic Wan folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WanSynthShape {
    /// The transformer's width (`num_attention_heads x 128`).
    pub dim: u64,
    /// Its feed-forward width.
    pub ffn: u64,
    /// Its blocks.
    pub layers: u64,
    /// umT5 layers (d_model 4096, d_ff 10240, 64 heads, as umT5-XXL).
    pub text_layers: u64,
    /// umT5's vocabulary (the tokenizer is padded to it); `None`: the tokenizer's own pieces.
    pub text_vocab: Option<u64>,
    /// The VAE's `base_dim` (96 in Wan 2.1).
    pub vae_base_dim: u64,
}

/// A transformer block's NF4 bytes at width `dim` and feed-forward `ffn` (8 square linears,
/// the two FFN linears; 4 bits a weight).
fn block_bytes(dim: u64, ffn: u64) -> u64 {
    (8 * dim * dim + 2 * dim * ffn) / 2
}

impl WanSynthShape {
    /// `Wan-AI/Wan2.1-T2V-1.3B-Diffusers`: 30 blocks of 1536 (12 heads), FFN 8960.
    pub fn real_1_3b() -> Self {
        WanSynthShape {
            dim: 1536,
            ffn: 8960,
            layers: 30,
            text_layers: 24,
            text_vocab: Some(256_384),
            vae_base_dim: 96,
        }
    }

    /// `Wan-AI/Wan2.1-T2V-14B-Diffusers`: 40 blocks of 5120 (40 heads), FFN 13824.
    pub fn real_14b() -> Self {
        WanSynthShape {
            dim: 5120,
            ffn: 13824,
            layers: 40,
            ..Self::real_1_3b()
        }
    }

    /// A transformer of about `bytes`: the 14B's width above the 1.3B's size, the 1.3B's width
    /// down to two of its blocks, narrower below; two umT5 layers with the tokenizer's own
    /// vocabulary and the real VAE.
    pub fn scaled(bytes: u64) -> Self {
        let widths: [(u64, u64); 5] = [
            (5120, 13824),
            (1536, 8960),
            (768, 4480),
            (384, 2240),
            (128, 640),
        ];
        let big = 30 * block_bytes(1536, 8960);
        let (dim, ffn) = widths
            .iter()
            .copied()
            .filter(|&(d, _)| d != 5120 || bytes > big)
            .find(|&(d, f)| 2 * block_bytes(d, f) <= bytes)
            .unwrap_or(widths[4]);
        WanSynthShape {
            dim,
            ffn,
            layers: (bytes / block_bytes(dim, ffn)).max(1),
            text_layers: 2,
            text_vocab: None,
            vae_base_dim: 96,
        }
    }
}

/// The NF4 `WanTransformer3DModel` of `s` (16 latent channels, patch 1 x 2 x 2, text 4096).
fn transformer(s: WanSynthShape, seed: u64) -> SynthModel {
    let (d, ffn, z, text, freq) = (s.dim, s.ffn, 16u64, 4096u64, 256u64);
    let heads = (d / 128).max(1);
    let mut t: Vec<(String, Kind)> = Vec::new();
    let sd = |fan_in: u64| 1.0 / (fan_in as f32).sqrt();
    t.push((
        "patch_embedding.weight".into(),
        Kind::Normal(vec![d, z, 1, 2, 2], sd(4 * z)),
    ));
    t.push(("patch_embedding.bias".into(), Kind::Dense(vec![d], 0.0)));
    let c = "condition_embedder";
    linear(
        &mut t,
        &format!("{c}.time_embedder.linear_1"),
        d,
        freq,
        false,
        true,
    );
    linear(
        &mut t,
        &format!("{c}.time_embedder.linear_2"),
        d,
        d,
        false,
        true,
    );
    linear(&mut t, &format!("{c}.time_proj"), 6 * d, d, true, true);
    linear(
        &mut t,
        &format!("{c}.text_embedder.linear_1"),
        d,
        text,
        true,
        true,
    );
    linear(
        &mut t,
        &format!("{c}.text_embedder.linear_2"),
        d,
        d,
        true,
        true,
    );
    for b in 0..s.layers {
        let p = format!("blocks.{b}");
        for a in ["attn1", "attn2"] {
            for q in ["to_q", "to_k", "to_v", "to_out.0"] {
                linear(&mut t, &format!("{p}.{a}.{q}"), d, d, true, true);
            }
            // RMS norms across heads: one weight per channel.
            norm(&mut t, &format!("{p}.{a}.norm_q"), d, false);
            norm(&mut t, &format!("{p}.{a}.norm_k"), d, false);
        }
        norm(&mut t, &format!("{p}.norm2"), d, true);
        linear(&mut t, &format!("{p}.ffn.net.0.proj"), ffn, d, true, true);
        linear(&mut t, &format!("{p}.ffn.net.2"), d, ffn, true, true);
        t.push((
            format!("{p}.scale_shift_table"),
            Kind::Normal(vec![1, 6, d], sd(d)),
        ));
    }
    t.push((
        "scale_shift_table".into(),
        Kind::Normal(vec![1, 2, d], sd(d)),
    ));
    linear(&mut t, "proj_out", 4 * z, d, true, true);
    let config = json!({
        "_class_name": "WanTransformer3DModel", "_diffusers_version": "0.42.1",
        "added_kv_proj_dim": null, "attention_head_dim": d / heads, "cross_attn_norm": true,
        "eps": 1e-6, "ffn_dim": ffn, "freq_dim": freq, "image_dim": null, "in_channels": z,
        "num_attention_heads": heads, "num_layers": s.layers, "out_channels": z,
        "patch_size": [1, 2, 2], "pos_embed_seq_len": null, "qk_norm": "rms_norm_across_heads",
        "rope_max_seq_len": 1024, "text_dim": text,
        "quantization_config": quantization_config(),
        "nibble_synthetic": {"seed": seed},
    });
    SynthModel::from_parts(
        config,
        t,
        "diffusion_pytorch_model.safetensors",
        "diffusion_pytorch_model.safetensors.index.json",
        seed,
    )
}

/// A causal 3D convolution (`k` x `k` x `k`, or 1 x 1 x 1) with variance-keeping weights.
fn conv3(t: &mut Vec<(String, Kind)>, name: &str, out: u64, inp: u64, k: [u64; 3]) {
    let sd = 1.0 / ((inp * k[0] * k[1] * k[2]) as f32).sqrt();
    t.push((
        format!("{name}.weight"),
        Kind::Normal(vec![out, inp, k[0], k[1], k[2]], sd),
    ));
    t.push((format!("{name}.bias"), Kind::Dense(vec![out], 0.0)));
}

/// An RMS norm's `gamma` over `c` channels (`[c, 1, 1, 1]`, or `[c, 1, 1]` for images).
fn gamma(t: &mut Vec<(String, Kind)>, name: &str, c: u64, video: bool) {
    let shape = if video {
        vec![c, 1, 1, 1]
    } else {
        vec![c, 1, 1]
    };
    t.push((format!("{name}.gamma"), Kind::Dense(shape, 1.0)));
}

fn resblock(t: &mut Vec<(String, Kind)>, p: &str, inp: u64, out: u64) {
    gamma(t, &format!("{p}.norm1"), inp, true);
    conv3(t, &format!("{p}.conv1"), out, inp, [3, 3, 3]);
    gamma(t, &format!("{p}.norm2"), out, true);
    conv3(t, &format!("{p}.conv2"), out, out, [3, 3, 3]);
    if inp != out {
        conv3(t, &format!("{p}.conv_shortcut"), out, inp, [1, 1, 1]);
    }
}

/// `AutoencoderKLWan`'s decoder (and `post_quant_conv`) with Wan 2.1's layout: z 16,
/// `dim_mult` [1, 2, 4, 4], two residual blocks per level (three in the decoder), temporal
/// upsampling in the first two up blocks.
fn vae(base: u64, seed: u64) -> SynthModel {
    let (z, mult, res) = (16u64, [1u64, 2, 4, 4], 2u64);
    let down = [false, true, true];
    let up: Vec<bool> = down.iter().rev().copied().collect();
    let dims: Vec<u64> = std::iter::once(mult[3])
        .chain(mult.iter().rev().copied())
        .map(|m| m * base)
        .collect();
    let mut t = Vec::new();
    conv3(&mut t, "post_quant_conv", z, z, [1, 1, 1]);
    conv3(&mut t, "decoder.conv_in", dims[0], z, [3, 3, 3]);
    let m = "decoder.mid_block";
    resblock(&mut t, &format!("{m}.resnets.0"), dims[0], dims[0]);
    let a = format!("{m}.attentions.0");
    gamma(&mut t, &format!("{a}.norm"), dims[0], false);
    let sd = 1.0 / (dims[0] as f32).sqrt();
    t.push((
        format!("{a}.to_qkv.weight"),
        Kind::Normal(vec![3 * dims[0], dims[0], 1, 1], sd),
    ));
    t.push((
        format!("{a}.to_qkv.bias"),
        Kind::Dense(vec![3 * dims[0]], 0.0),
    ));
    t.push((
        format!("{a}.proj.weight"),
        Kind::Normal(vec![dims[0], dims[0], 1, 1], sd),
    ));
    t.push((format!("{a}.proj.bias"), Kind::Dense(vec![dims[0]], 0.0)));
    resblock(&mut t, &format!("{m}.resnets.1"), dims[0], dims[0]);
    for i in 0..mult.len() {
        let (mut inp, out) = (dims[i], dims[i + 1]);
        if i > 0 {
            inp /= 2;
        }
        let u = format!("decoder.up_blocks.{i}");
        for r in 0..=res {
            resblock(&mut t, &format!("{u}.resnets.{r}"), inp, out);
            inp = out;
        }
        if i + 1 < mult.len() {
            let sd = 1.0 / ((out * 9) as f32).sqrt();
            t.push((
                format!("{u}.upsamplers.0.resample.1.weight"),
                Kind::Normal(vec![out / 2, out, 3, 3], sd),
            ));
            t.push((
                format!("{u}.upsamplers.0.resample.1.bias"),
                Kind::Dense(vec![out / 2], 0.0),
            ));
            if up[i] {
                conv3(
                    &mut t,
                    &format!("{u}.upsamplers.0.time_conv"),
                    2 * out,
                    out,
                    [3, 1, 1],
                );
            }
        }
    }
    gamma(&mut t, "decoder.norm_out", dims[4], true);
    conv3(&mut t, "decoder.conv_out", 3, dims[4], [3, 3, 3]);
    let config = json!({
        "_class_name": "AutoencoderKLWan", "_diffusers_version": "0.42.1", "attn_scales": [],
        "base_dim": base, "decoder_base_dim": null, "dim_mult": mult, "dropout": 0.0,
        "in_channels": 3, "is_residual": false,
        "latents_mean": [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                         0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921],
        "latents_std": [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                        3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.916],
        "num_res_blocks": res, "out_channels": 3, "patch_size": null,
        "scale_factor_spatial": 8, "scale_factor_temporal": 4,
        "temperal_downsample": down, "z_dim": z,
        "nibble_synthetic": {"seed": seed, "decoder_only": true},
    });
    SynthModel::from_parts(
        config,
        t,
        "diffusion_pytorch_model.safetensors",
        "diffusion_pytorch_model.safetensors.index.json",
        seed,
    )
}

/// umT5's `tokenizer.json`: the T5 unigram tokenizer of the Flux synth, padded with unused
/// pieces to `vocab` entries when given.
fn tokenizer(vocab: Option<u64>) -> serde_json::Value {
    let mut tok = t5_tokenizer_json();
    if let (Some(v), Some(pieces)) = (vocab, tok["model"]["vocab"].as_array_mut()) {
        let have = pieces.len() as u64;
        for k in have..v {
            pieces.push(json!([format!("<unused_{k}>"), -100.0]));
        }
    }
    tok
}

/// The three models of a synthetic Wan folder, by component folder.
pub fn components(s: WanSynthShape, seed: u64) -> Vec<(&'static str, SynthModel)> {
    let pieces = tokenizer(s.text_vocab)["model"]["vocab"]
        .as_array()
        .map_or(0, |v| v.len()) as u64;
    vec![
        (
            "text_encoder",
            t5(
                s.text_vocab.unwrap_or(pieces.div_ceil(128) * 128),
                s.text_layers,
                seed + 2,
                true,
            ),
        ),
        ("transformer", transformer(s, seed)),
        ("vae", vae(s.vae_base_dim, seed + 3)),
    ]
}

/// Bytes of tensor data a folder of `s` holds.
pub fn tensor_bytes(s: WanSynthShape) -> u64 {
    components(s, 0).iter().map(|(_, m)| m.tensor_bytes()).sum()
}

/// Writes the whole Wan folder into `dir`, calling `progress(component, done, total)` as the
/// models' bytes are written.
pub fn write_pipeline(
    dir: &Path,
    s: WanSynthShape,
    seed: u64,
    mut progress: impl FnMut(&str, u64, u64),
) -> Result<()> {
    write_json(
        &dir.join("model_index.json"),
        &json!({
            "_class_name": "WanPipeline", "_diffusers_version": "0.42.1",
            "scheduler": ["diffusers", "UniPCMultistepScheduler"],
            "text_encoder": ["transformers", "UMT5EncoderModel"],
            "tokenizer": ["transformers", "T5TokenizerFast"],
            "transformer": ["diffusers", "WanTransformer3DModel"],
            "vae": ["diffusers", "AutoencoderKLWan"],
        }),
    )?;
    write_json(
        &dir.join("scheduler/scheduler_config.json"),
        &json!({
            "_class_name": "UniPCMultistepScheduler", "_diffusers_version": "0.42.1",
            "beta_end": 0.02, "beta_schedule": "linear", "beta_start": 0.0001,
            "disable_corrector": [], "dynamic_thresholding_ratio": 0.995,
            "final_sigmas_type": "zero", "flow_shift": 3.0, "lower_order_final": true,
            "num_train_timesteps": 1000, "predict_x0": true, "prediction_type": "flow_prediction",
            "rescale_betas_zero_snr": false, "sample_max_value": 1.0, "solver_order": 2,
            "solver_p": null, "solver_type": "bh2", "steps_offset": 0, "thresholding": false,
            "timestep_spacing": "linspace", "trained_betas": null, "use_beta_sigmas": false,
            "use_exponential_sigmas": false, "use_flow_sigmas": true, "use_karras_sigmas": false,
        }),
    )?;
    write_t5_tokenizer(&dir.join("tokenizer"), &tokenizer(s.text_vocab))?;
    for (name, model) in components(s, seed) {
        model.write(&dir.join(name), |done, total| progress(name, done, total))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scaled_shapes_keep_real_widths_where_they_fit() {
        assert_eq!(WanSynthShape::scaled(600 << 20).dim, 1536);
        assert_eq!(WanSynthShape::scaled(7 << 30).dim, 5120);
        assert_eq!(WanSynthShape::scaled(4 << 20).dim, 384);
        let one = WanSynthShape::real_1_3b();
        let b = block_bytes(one.dim, one.ffn) * one.layers;
        // 1.42 billion parameters, about 1.3 billion of them in the blocks.
        assert!((b * 2) > 1_200_000_000 && (b * 2) < 1_420_000_000, "{b}");
    }
}
