//! The decoder's `config.json`, typed: transformers' `LlamaConfig`, `MistralConfig` and
//! `Qwen2Config` fields with their defaults where the file leaves one out, and every value
//! checked (sizes at least 1, heads that group, finite positive constants, token ids that are
//! u32s); an error names the file and the field.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::format::json::{field_error, positive, positive_f32, typed, TokenIds, MAX_SIZE};
use crate::io::model::ModelIndex;

/// The `model_type`s whose decoders this graph computes.
pub const MODEL_TYPES: [&str; 4] = ["llama", "mistral", "qwen2", "smollm"];

/// RoPE frequency scaling from `rope_scaling` / `rope_parameters`.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// None.
    Default,
    /// Positions divided by `factor`.
    Linear {
        /// The factor.
        factor: f32,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        /// Scale of low frequencies.
        factor: f32,
        /// Wavelength bound (as a divisor of the original context) below which frequencies are scaled.
        low_freq_factor: f32,
        /// Wavelength bound above which frequencies are kept.
        high_freq_factor: f32,
        /// The context length the model was trained with.
        original_max_position_embeddings: f32,
    },
}

/// The decoder's hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    /// Model width.
    pub hidden: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Decoder layers.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Vocabulary size.
    pub vocab: usize,
    /// RMSNorm epsilon.
    pub rms_eps: f32,
    /// RoPE base.
    pub rope_theta: f32,
    /// RoPE frequency scaling.
    pub rope_scaling: RopeScaling,
    /// Whether lm_head reuses the embedding table.
    pub tied: bool,
    /// Beginning-of-sequence token, if the config names one.
    pub bos: Option<u32>,
    /// End-of-sequence tokens (a config may list several).
    pub eos: Vec<u32>,
    /// Longest context the model was trained for.
    pub max_positions: usize,
    /// The attention window where the model uses sliding-window attention (Mistral's
    /// `sliding_window`, Qwen2's with `use_sliding_window`); the graph attends to every earlier
    /// position, so it runs such a model only for sequences that fit the window.
    pub sliding_window: Option<usize>,
    /// With `dynamic` RoPE scaling: the trained length, up to which its frequencies are the
    /// default ones (the graph runs only sequences that fit).
    pub dynamic_rope_limit: Option<usize>,
}

/// `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5).
#[derive(Debug, Clone, Deserialize)]
struct RopeFile {
    rope_type: Option<String>,
    #[serde(rename = "type")]
    kind: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f64>,
    low_freq_factor: Option<f64>,
    high_freq_factor: Option<f64>,
    original_max_position_embeddings: Option<u64>,
}

/// `config.json` as transformers writes it; fields nibble does not use are ignored.
#[derive(Debug, Clone, Deserialize)]
struct ConfigFile {
    model_type: Option<String>,
    vocab_size: Option<u64>,
    hidden_size: Option<u64>,
    intermediate_size: Option<u64>,
    num_hidden_layers: Option<u64>,
    num_attention_heads: Option<u64>,
    num_key_value_heads: Option<u64>,
    head_dim: Option<u64>,
    hidden_act: Option<String>,
    max_position_embeddings: Option<u64>,
    rms_norm_eps: Option<f64>,
    bos_token_id: Option<TokenIds>,
    eos_token_id: Option<TokenIds>,
    tie_word_embeddings: Option<bool>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RopeFile>,
    rope_parameters: Option<RopeFile>,
    /// Absent and `null` differ: Mistral's default window applies only when the key is absent.
    #[serde(default, deserialize_with = "present")]
    sliding_window: Option<Option<u64>>,
    use_sliding_window: Option<bool>,
}

fn present<'de, D: serde::Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> std::result::Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// The defaults of the transformers config class of a `model_type`, for the fields a file may
/// leave out.
struct Defaults {
    vocab_size: u64,
    hidden_size: u64,
    intermediate_size: u64,
    num_hidden_layers: u64,
    num_attention_heads: u64,
    /// `None`: as many as the query heads.
    num_key_value_heads: Option<u64>,
    max_position_embeddings: u64,
    bos_token_id: Option<u64>,
    eos_token_id: Option<u64>,
    sliding_window: Option<u64>,
}

fn defaults(model_type: &str) -> Defaults {
    match model_type {
        // transformers.MistralConfig.__init__: vocab_size=32000, hidden_size=4096,
        // intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
        // num_key_value_heads=8, max_position_embeddings=4096 * 32, bos_token_id=1,
        // eos_token_id=2, sliding_window=4096.
        "mistral" => Defaults {
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: Some(8),
            max_position_embeddings: 4096 * 32,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            sliding_window: Some(4096),
        },
        // transformers.Qwen2Config.__init__: vocab_size=151936, hidden_size=4096,
        // intermediate_size=22016, num_hidden_layers=32, num_attention_heads=32,
        // num_key_value_heads=32, max_position_embeddings=32768, sliding_window=4096 (used only
        // with use_sliding_window=True); no bos/eos ids.
        "qwen2" => Defaults {
            vocab_size: 151936,
            hidden_size: 4096,
            intermediate_size: 22016,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: Some(32),
            max_position_embeddings: 32768,
            bos_token_id: None,
            eos_token_id: None,
            sliding_window: Some(4096),
        },
        // transformers.LlamaConfig.__init__ (and the Llama-architecture SmolLM): vocab_size=32000,
        // hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        // num_attention_heads=32, num_key_value_heads=None, max_position_embeddings=2048,
        // bos_token_id=1, eos_token_id=2; no sliding window.
        _ => Defaults {
            vocab_size: 32000,
            hidden_size: 4096,
            intermediate_size: 11008,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: None,
            max_position_embeddings: 2048,
            bos_token_id: Some(1),
            eos_token_id: Some(2),
            sliding_window: None,
        },
    }
}

impl LlamaConfig {
    /// The decoder's configuration from `model`'s `config.json`.
    pub fn of(model: &ModelIndex) -> Result<Self> {
        let file = model.locate("config.json");
        let c = model.config.as_ref().ok_or_else(|| Error::Model {
            file: file.clone(),
            msg: "not found: a language model needs its config.json".into(),
        })?;
        Self::from_json(&file, c)
    }

    /// Reads a transformers `config.json` (`file` names it in errors).
    pub fn from_json(file: &str, c: &serde_json::Value) -> Result<Self> {
        let f: ConfigFile = typed(file, c)?;
        let model_type = f.model_type.as_deref().unwrap_or("llama");
        if !MODEL_TYPES.contains(&model_type) {
            return Err(field_error(
                file,
                "model_type",
                format!(
                    "'{model_type}' is not a decoder nibble computes ({})",
                    MODEL_TYPES.join(", ")
                ),
            ));
        }
        let d = defaults(model_type);
        // transformers: hidden_act="silu".
        let act = f.hidden_act.as_deref().unwrap_or("silu");
        if act != "silu" {
            return Err(field_error(
                file,
                "hidden_act",
                format!("'{act}' is not supported (silu)"),
            ));
        }
        let hidden = positive(file, "hidden_size", f.hidden_size.unwrap_or(d.hidden_size))?;
        let heads = positive(
            file,
            "num_attention_heads",
            f.num_attention_heads.unwrap_or(d.num_attention_heads),
        )?;
        let kv_heads = positive(
            file,
            "num_key_value_heads",
            f.num_key_value_heads
                .or(d.num_key_value_heads)
                .unwrap_or(heads as u64),
        )?;
        if heads % kv_heads != 0 {
            return Err(field_error(
                file,
                "num_key_value_heads",
                format!("{heads} attention heads do not group over {kv_heads} key/value heads"),
            ));
        }
        // transformers: head_dim = hidden_size // num_attention_heads when not given.
        let head_dim = match f.head_dim {
            Some(h) => positive(file, "head_dim", h)?,
            None if hidden % heads == 0 => hidden / heads,
            None => {
                return Err(field_error(
                    file,
                    "num_attention_heads",
                    format!("{heads} heads do not divide hidden_size {hidden} (and no head_dim)"),
                ))
            }
        };
        for (field, n) in [
            ("num_attention_heads", heads),
            ("num_key_value_heads", kv_heads),
        ] {
            if n.checked_mul(head_dim).is_none_or(|w| w as u64 > MAX_SIZE) {
                return Err(field_error(
                    file,
                    field,
                    format!("{n} heads x head_dim {head_dim} is larger than any model nibble runs"),
                ));
            }
        }
        if head_dim % 2 != 0 {
            return Err(field_error(
                file,
                "head_dim",
                format!("{head_dim} is odd: rotary embeddings pair the dimensions"),
            ));
        }
        // transformers: rms_norm_eps=1e-6, rope_theta=10000.0 (transformers 5 keeps it in
        // rope_parameters).
        let rms_eps = positive_f32(file, "rms_norm_eps", f.rms_norm_eps.unwrap_or(1e-6))?;
        let rope = f.rope_scaling.clone().or(f.rope_parameters.clone());
        let theta = f
            .rope_theta
            .or_else(|| f.rope_parameters.as_ref().and_then(|r| r.rope_theta))
            .unwrap_or(10000.0);
        let rope_theta = positive_f32(file, "rope_theta", theta)?;
        let max_positions = positive(
            file,
            "max_position_embeddings",
            f.max_position_embeddings
                .unwrap_or(d.max_position_embeddings),
        )?;
        let kind = rope
            .as_ref()
            .and_then(|r| r.rope_type.clone().or(r.kind.clone()))
            .unwrap_or_else(|| "default".into());
        let factor = |field: &str, default: f64| {
            positive_f32(
                file,
                field,
                rope.as_ref()
                    .and_then(|r| match field {
                        "rope_scaling.factor" => r.factor,
                        "rope_scaling.low_freq_factor" => r.low_freq_factor,
                        "rope_scaling.high_freq_factor" => r.high_freq_factor,
                        _ => None,
                    })
                    .unwrap_or(default),
            )
        };
        let rope_scaling = match kind.as_str() {
            // Dynamic NTK changes the frequencies only past the trained length; within it
            // transformers uses the default ones (the graph refuses longer runs).
            "default" | "dynamic" => RopeScaling::Default,
            "linear" => RopeScaling::Linear {
                factor: factor("rope_scaling.factor", 1.0)?,
            },
            // transformers' _compute_llama3_parameters reads factor, low_freq_factor,
            // high_freq_factor and original_max_position_embeddings.
            "llama3" => RopeScaling::Llama3 {
                factor: factor("rope_scaling.factor", 8.0)?,
                low_freq_factor: factor("rope_scaling.low_freq_factor", 1.0)?,
                high_freq_factor: factor("rope_scaling.high_freq_factor", 4.0)?,
                original_max_position_embeddings: rope
                    .as_ref()
                    .and_then(|r| r.original_max_position_embeddings)
                    .unwrap_or(8192) as f32,
            },
            other => {
                return Err(field_error(
                    file,
                    "rope_scaling.rope_type",
                    format!("'{other}' is not supported (default, linear, llama3, dynamic)"),
                ))
            }
        };
        if let RopeScaling::Llama3 {
            low_freq_factor,
            high_freq_factor,
            ..
        } = rope_scaling
        {
            if low_freq_factor >= high_freq_factor {
                return Err(field_error(
                    file,
                    "rope_scaling.low_freq_factor",
                    "must be below high_freq_factor",
                ));
            }
        }
        let dynamic_rope_limit = (kind == "dynamic").then(|| {
            rope.as_ref()
                .and_then(|r| r.original_max_position_embeddings)
                .map(|v| v as usize)
                .unwrap_or(max_positions)
        });
        let window = match f.sliding_window {
            Some(w) => w,
            None => d.sliding_window,
        };
        let sliding_window = match model_type {
            // Qwen2 attends through its window only with use_sliding_window (default False).
            "qwen2" if f.use_sliding_window != Some(true) => None,
            _ => window,
        }
        .map(|w| positive(file, "sliding_window", w))
        .transpose()?;
        let ids = |v: &Option<TokenIds>, default: Option<u64>, field: &str| -> Result<Vec<u32>> {
            match (v, c.get(field).is_some()) {
                (Some(t), _) => t.ids(file, field),
                // Explicitly null: none.
                (None, true) => Ok(Vec::new()),
                (None, false) => TokenIds::Many(default.into_iter().collect()).ids(file, field),
            }
        };
        Ok(LlamaConfig {
            hidden,
            intermediate: positive(
                file,
                "intermediate_size",
                f.intermediate_size.unwrap_or(d.intermediate_size),
            )?,
            layers: positive(
                file,
                "num_hidden_layers",
                f.num_hidden_layers.unwrap_or(d.num_hidden_layers),
            )?,
            heads,
            kv_heads,
            head_dim,
            vocab: positive(file, "vocab_size", f.vocab_size.unwrap_or(d.vocab_size))?,
            rms_eps,
            rope_theta,
            rope_scaling,
            // transformers: tie_word_embeddings=False.
            tied: f.tie_word_embeddings.unwrap_or(false),
            bos: ids(&f.bos_token_id, d.bos_token_id, "bos_token_id")?
                .first()
                .copied(),
            eos: ids(&f.eos_token_id, d.eos_token_id, "eos_token_id")?,
            max_positions,
            sliding_window,
            dynamic_rope_limit,
        })
    }

    /// The inverse frequencies, as transformers computes them in f32 (`1 / theta^(2i / d)`,
    /// then the scaling rule).
    pub fn inv_freq(&self) -> Vec<f32> {
        let half = self.head_dim / 2;
        let base: Vec<f32> = (0..half)
            .map(|i| 1.0 / self.rope_theta.powf((2 * i) as f32 / self.head_dim as f32))
            .collect();
        match self.rope_scaling {
            RopeScaling::Default => base,
            RopeScaling::Linear { factor } => base.iter().map(|f| f / factor).collect(),
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings: old,
            } => {
                let low_wl = old / low_freq_factor;
                let high_wl = old / high_freq_factor;
                base.iter()
                    .map(|&f| {
                        let wl = 2.0 * std::f32::consts::PI / f;
                        let scaled = if wl > low_wl { f / factor } else { f };
                        let medium = wl >= high_wl && wl <= low_wl;
                        if medium {
                            let smooth =
                                (old / wl - low_freq_factor) / (high_freq_factor - low_freq_factor);
                            (1.0 - smooth) * scaled / factor + smooth * scaled
                        } else {
                            scaled
                        }
                    })
                    .collect()
            }
        }
    }

    /// cos and sin tables `[T, head_dim / 2]` for positions `0..t` (see [`Self::rope_at`]).
    pub fn rope_tables(&self, t: usize) -> (Vec<f32>, Vec<f32>) {
        self.rope_at(0, t)
    }

    /// cos and sin tables `[T, head_dim / 2]` for positions `start..start + t`, in f32 as
    /// transformers computes them (`freqs = pos * inv_freq`).
    pub fn rope_at(&self, start: usize, t: usize) -> (Vec<f32>, Vec<f32>) {
        let inv = self.inv_freq();
        let mut cos = Vec::with_capacity(t * inv.len());
        let mut sin = Vec::with_capacity(t * inv.len());
        for p in start..start + t {
            for f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        (cos, sin)
    }
}
