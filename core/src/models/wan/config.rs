//! What the Wan transformer's graph needs of `transformer/config.json`
//! (`WanTransformer3DModel`, diffusers 0.42), checked; what nibble does not compute (image
//! conditioning, another q/k norm) is refused naming the field.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::format::json::positive;
use crate::io::model::ModelIndex;
use crate::models::typed_config;

/// The transformer's sizes.
#[derive(Debug, Clone, PartialEq)]
pub struct WanConfig {
    /// Heads.
    pub heads: usize,
    /// Width of a head (`attention_head_dim`).
    pub head_dim: usize,
    /// Latent channels in and out.
    pub in_channels: usize,
    /// Channels the output head predicts per latent position.
    pub out_channels: usize,
    /// Width of the text encoder's states (`text_dim`).
    pub text_dim: usize,
    /// The timestep sinusoid's width (`freq_dim`).
    pub freq_dim: usize,
    /// The feed-forward's width.
    pub ffn_dim: usize,
    /// Blocks.
    pub layers: usize,
    /// The patch, (frames, height, width).
    pub patch: (usize, usize, usize),
    /// Epsilon of the norms.
    pub eps: f32,
    /// The cross-attention's input norm has weights (`cross_attn_norm`).
    pub cross_attn_norm: bool,
    /// Positions the rotary tables cover per axis (`rope_max_seq_len`).
    pub rope_max_seq_len: usize,
}

impl WanConfig {
    /// The model width.
    pub fn dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Values of one patch (`in_channels` x the patch's frames, rows and columns).
    pub fn patch_values(&self) -> usize {
        self.in_channels * self.patch.0 * self.patch.1 * self.patch.2
    }

    /// Values the output head predicts per token.
    pub fn out_values(&self) -> usize {
        self.out_channels * self.patch.0 * self.patch.1 * self.patch.2
    }

    /// The rotary sizes per head (frames, rows, columns), as diffusers splits the head:
    /// `head_dim − 4·(head_dim/6)`, `2·(head_dim/6)`, `2·(head_dim/6)`.
    pub fn rope_dims(&self) -> (usize, usize, usize) {
        let hw = 2 * (self.head_dim / 6);
        (self.head_dim - 2 * hw, hw, hw)
    }
}

#[derive(Deserialize)]
struct File {
    #[serde(rename = "_class_name")]
    class_name: Option<String>,
    num_attention_heads: u64,
    attention_head_dim: u64,
    in_channels: u64,
    out_channels: Option<u64>,
    text_dim: u64,
    freq_dim: Option<u64>,
    ffn_dim: u64,
    num_layers: u64,
    patch_size: Vec<u64>,
    eps: Option<f64>,
    cross_attn_norm: Option<bool>,
    qk_norm: Option<String>,
    image_dim: Option<u64>,
    added_kv_proj_dim: Option<u64>,
    rope_max_seq_len: Option<u64>,
}

impl WanConfig {
    /// From the transformer's `config.json`.
    pub fn of(model: &ModelIndex) -> Result<Self> {
        let (file, f): (String, File) = typed_config(model, "the Wan transformer")?;
        let bad = |msg: String| Error::Model {
            file: file.clone(),
            msg,
        };
        if let Some(c) = f
            .class_name
            .as_deref()
            .filter(|c| *c != "WanTransformer3DModel")
        {
            return Err(bad(format!("_class_name {c} is not WanTransformer3DModel")));
        }
        match f.qk_norm.as_deref() {
            Some("rms_norm_across_heads") => {}
            other => {
                return Err(bad(format!(
                    "qk_norm {other:?} is not supported (rms_norm_across_heads)"
                )))
            }
        }
        if f.image_dim.is_some() || f.added_kv_proj_dim.is_some() {
            return Err(bad(
                "image_dim / added_kv_proj_dim: image-to-video conditioning is not supported"
                    .into(),
            ));
        }
        if f.patch_size.len() != 3 {
            return Err(bad(format!(
                "patch_size {:?}: three sizes (frames, height, width)",
                f.patch_size
            )));
        }
        let p = |i: usize, name: &str| positive(&file, name, f.patch_size[i]);
        let c = WanConfig {
            heads: positive(&file, "num_attention_heads", f.num_attention_heads)?,
            head_dim: positive(&file, "attention_head_dim", f.attention_head_dim)?,
            in_channels: positive(&file, "in_channels", f.in_channels)?,
            out_channels: positive(
                &file,
                "out_channels",
                f.out_channels.unwrap_or(f.in_channels),
            )?,
            text_dim: positive(&file, "text_dim", f.text_dim)?,
            freq_dim: positive(&file, "freq_dim", f.freq_dim.unwrap_or(256))?,
            ffn_dim: positive(&file, "ffn_dim", f.ffn_dim)?,
            layers: positive(&file, "num_layers", f.num_layers)?,
            patch: (
                p(0, "patch_size[0]")?,
                p(1, "patch_size[1]")?,
                p(2, "patch_size[2]")?,
            ),
            eps: f.eps.unwrap_or(1e-6) as f32,
            cross_attn_norm: f.cross_attn_norm.unwrap_or(true),
            rope_max_seq_len: positive(
                &file,
                "rope_max_seq_len",
                f.rope_max_seq_len.unwrap_or(1024),
            )?,
        };
        if !c.head_dim.is_multiple_of(2) || c.head_dim < 6 || !c.freq_dim.is_multiple_of(2) {
            return Err(bad(format!(
                "attention_head_dim {} and freq_dim {}: even, and a head of at least 6",
                c.head_dim, c.freq_dim
            )));
        }
        if c.out_channels != c.in_channels {
            return Err(bad(format!(
                "out_channels {} differs from in_channels {}: the sampler needs one velocity per \
                 latent value",
                c.out_channels, c.in_channels
            )));
        }
        if !(c.eps.is_finite() && c.eps > 0.0) {
            return Err(bad(format!(
                "eps {} is not a finite positive number",
                c.eps
            )));
        }
        Ok(c)
    }
}
