//! A Flux-style DiT's `config.json` (diffusers' `FluxTransformer2DModel`), typed, with
//! diffusers' defaults where the file leaves one out; an error names the file and the field.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::format::json::{field_error, positive, typed, MAX_SIZE};
use crate::io::model::ModelIndex;

/// The model's hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct DitConfig {
    /// Token width of the latent.
    pub in_channels: usize,
    /// Output token width: `patch_size² x out_channels` (`out_channels` defaulting to
    /// `in_channels`), the width of diffusers' `proj_out`.
    pub out_channels: usize,
    /// Double-stream blocks.
    pub double_blocks: usize,
    /// Single-stream blocks.
    pub single_blocks: usize,
    /// Heads.
    pub heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Text embedding width.
    pub joint_dim: usize,
    /// Pooled text embedding width.
    pub pooled_dim: usize,
    /// Whether a guidance embedding is added.
    pub guidance: bool,
    /// RoPE dims per id axis (sum = head_dim).
    pub axes_dims: Vec<usize>,
}

/// `config.json` as diffusers writes it.
#[derive(Debug, Deserialize)]
struct ConfigFile {
    patch_size: Option<u64>,
    in_channels: Option<u64>,
    out_channels: Option<u64>,
    num_layers: Option<u64>,
    num_single_layers: Option<u64>,
    attention_head_dim: Option<u64>,
    num_attention_heads: Option<u64>,
    joint_attention_dim: Option<u64>,
    pooled_projection_dim: Option<u64>,
    guidance_embeds: Option<bool>,
    axes_dims_rope: Option<Vec<u64>>,
}

impl DitConfig {
    /// The transformer's configuration from `model`'s `config.json`.
    pub fn of(model: &ModelIndex) -> Result<Self> {
        let file = model.locate("config.json");
        let c = model.config.as_ref().ok_or_else(|| Error::Model {
            file: file.clone(),
            msg: "not found: a DiT needs its config.json".into(),
        })?;
        Self::from_json(&file, c)
    }

    /// Reads a diffusers `config.json` (`file` names it in errors).
    pub fn from_json(file: &str, c: &serde_json::Value) -> Result<Self> {
        let f: ConfigFile = typed(file, c)?;
        // diffusers.FluxTransformer2DModel.__init__: patch_size=1, in_channels=64,
        // out_channels=None (in_channels), num_layers=19, num_single_layers=38,
        // attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096,
        // pooled_projection_dim=768, guidance_embeds=False, axes_dims_rope=(16, 56, 56).
        let in_channels = positive(file, "in_channels", f.in_channels.unwrap_or(64))?;
        let patch = positive(file, "patch_size", f.patch_size.unwrap_or(1))?;
        let out = match f.out_channels {
            Some(o) => positive(file, "out_channels", o)?,
            None => in_channels,
        };
        let out_channels = patch
            .checked_mul(patch)
            .and_then(|p| p.checked_mul(out))
            .ok_or_else(|| {
                field_error(file, "patch_size", "patch_size² x out_channels overflows")
            })?;
        let head_dim = positive(
            file,
            "attention_head_dim",
            f.attention_head_dim.unwrap_or(128),
        )?;
        let axes_dims = f
            .axes_dims_rope
            .unwrap_or_else(|| vec![16, 56, 56])
            .into_iter()
            .map(|a| positive(file, "axes_dims_rope", a))
            .collect::<Result<Vec<usize>>>()?;
        if axes_dims.iter().any(|a| a % 2 != 0) {
            return Err(field_error(
                file,
                "axes_dims_rope",
                format!("{axes_dims:?}: rotary embeddings pair the dimensions of each axis"),
            ));
        }
        if axes_dims.iter().try_fold(0usize, |a, &b| a.checked_add(b)) != Some(head_dim) {
            return Err(field_error(
                file,
                "axes_dims_rope",
                format!("{axes_dims:?} do not sum to attention_head_dim {head_dim}"),
            ));
        }
        let heads = positive(
            file,
            "num_attention_heads",
            f.num_attention_heads.unwrap_or(24),
        )?;
        // The blocks' widest linear is 12 x the model width (adaLN's 6 x in two streams).
        if heads
            .checked_mul(head_dim)
            .and_then(|d| d.checked_mul(12))
            .is_none_or(|w| w as u64 > MAX_SIZE)
        {
            return Err(field_error(
                file,
                "num_attention_heads",
                format!("{heads} heads x {head_dim} is larger than any model nibble runs"),
            ));
        }
        Ok(DitConfig {
            in_channels,
            out_channels,
            double_blocks: positive(file, "num_layers", f.num_layers.unwrap_or(19))?,
            single_blocks: positive(file, "num_single_layers", f.num_single_layers.unwrap_or(38))?,
            heads,
            head_dim,
            joint_dim: positive(
                file,
                "joint_attention_dim",
                f.joint_attention_dim.unwrap_or(4096),
            )?,
            pooled_dim: positive(
                file,
                "pooled_projection_dim",
                f.pooled_projection_dim.unwrap_or(768),
            )?,
            guidance: f.guidance_embeds.unwrap_or(false),
            axes_dims,
        })
    }

    /// Model width.
    pub fn dim(&self) -> usize {
        self.heads * self.head_dim
    }

    /// cos / sin tables `[S, head_dim / 2]` for ids `[S, axes]` (text ids first, then image
    /// ids), computed in f64 and rounded to f32 as diffusers' `FluxPosEmbed` does.
    pub fn rope_tables(&self, ids: &[f32], theta: f64) -> (Vec<f32>, Vec<f32>) {
        let axes = self.axes_dims.len();
        let s = ids.len() / axes.max(1);
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for t in 0..s {
            for (a, &d) in self.axes_dims.iter().enumerate() {
                let pos = ids[t * axes + a] as f64;
                for j in 0..d / 2 {
                    let freq = 1.0 / theta.powf((2 * j) as f64 / d as f64);
                    let x = pos * freq;
                    cos.push(x.cos() as f32);
                    sin.push(x.sin() as f32);
                }
            }
        }
        (cos, sin)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(extra: serde_json::Value) -> serde_json::Value {
        let mut c = serde_json::json!({
            "in_channels": 16, "attention_head_dim": 16, "axes_dims_rope": [4, 6, 6],
            "num_layers": 1, "num_single_layers": 2, "num_attention_heads": 2,
            "joint_attention_dim": 32, "pooled_projection_dim": 32,
        });
        for (k, v) in extra.as_object().expect("object") {
            c[k] = v.clone();
        }
        c
    }

    /// `proj_out` is `patch_size² x (out_channels or in_channels)` wide, as in diffusers.
    #[test]
    fn output_width_follows_patch_size_and_out_channels() {
        let w = |extra| {
            DitConfig::from_json("config.json", &config(extra))
                .expect("config")
                .out_channels
        };
        assert_eq!(w(serde_json::json!({})), 16);
        assert_eq!(
            w(serde_json::json!({"out_channels": null, "patch_size": 1})),
            16
        );
        assert_eq!(w(serde_json::json!({"patch_size": 2})), 64);
        assert_eq!(
            w(serde_json::json!({"out_channels": 8, "patch_size": 2})),
            32
        );
    }

    #[test]
    fn wrong_types_and_sizes_name_the_field() {
        for (k, v, why) in [
            (
                "num_layers",
                serde_json::json!("1"),
                "num_layers: invalid type",
            ),
            (
                "attention_head_dim",
                serde_json::json!(0),
                "attention_head_dim: must be",
            ),
            (
                "axes_dims_rope",
                serde_json::json!([4, 6, 7]),
                "axes_dims_rope",
            ),
            ("axes_dims_rope", serde_json::json!([4, 6, 8]), "do not sum"),
            ("in_channels", serde_json::json!(-16), "in_channels"),
        ] {
            let mut extra = serde_json::Map::new();
            extra.insert(k.into(), v);
            let e = DitConfig::from_json("t/config.json", &config(extra.into()))
                .expect_err(k)
                .to_string();
            assert!(e.contains(why) && e.contains("t/config.json"), "{k}: {e}");
        }
    }

    #[test]
    fn euler_inputs_refuse_a_model_whose_output_is_not_the_latent() {
        let cfg =
            DitConfig::from_json("config.json", &config(serde_json::json!({"patch_size": 2})))
                .expect("config");
        let inputs = crate::models::dit::DitInputs::random(&cfg, 2, 2, 3, 3.5, 0).expect("inputs");
        let e = inputs
            .check(&cfg)
            .expect_err("64 values per token for 16 channels");
        assert!(
            e.to_string().contains("predicts 64 values per token"),
            "{e}"
        );
    }
}
