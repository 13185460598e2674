//! A BERT model's `config.json`, typed: transformers' `BertConfig` fields with their defaults
//! where the file leaves one out, and what the graph does not compute refused; an error names
//! the file and the field.

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::format::json::{field_error, positive, positive_f32, typed};
use crate::io::model::ModelIndex;

/// The encoder's hyper-parameters.
#[derive(Debug, Clone, PartialEq)]
pub struct BertConfig {
    /// Vocabulary size.
    pub vocab: usize,
    /// Hidden width.
    pub hidden: usize,
    /// Encoder layers.
    pub layers: usize,
    /// Attention heads.
    pub heads: usize,
    /// MLP width.
    pub intermediate: usize,
    /// Position embeddings (the longest sequence).
    pub max_positions: usize,
    /// Token types.
    pub type_vocab: usize,
    /// LayerNorm epsilon.
    pub eps: f32,
    /// The MLP's activation: exact erf GELU (`gelu`) or the tanh approximation (`gelu_new`,
    /// `gelu_pytorch_tanh`).
    pub gelu_tanh: bool,
}

/// `config.json` as transformers writes it for a `BertModel`.
#[derive(Debug, Deserialize)]
struct ConfigFile {
    vocab_size: Option<u64>,
    hidden_size: Option<u64>,
    num_hidden_layers: Option<u64>,
    num_attention_heads: Option<u64>,
    intermediate_size: Option<u64>,
    hidden_act: Option<String>,
    max_position_embeddings: Option<u64>,
    type_vocab_size: Option<u64>,
    layer_norm_eps: Option<f64>,
    position_embedding_type: Option<String>,
    is_decoder: Option<bool>,
}

impl BertConfig {
    /// The encoder's configuration from `model`'s `config.json`.
    pub fn of(model: &ModelIndex) -> Result<Self> {
        let file = model.locate("config.json");
        let c = model.config.as_ref().ok_or_else(|| Error::Model {
            file: file.clone(),
            msg: "not found: an encoder needs its config.json".into(),
        })?;
        Self::from_json(&file, c)
    }

    /// Reads a transformers `config.json` of a BERT model (`file` names it in errors).
    pub fn from_json(file: &str, c: &serde_json::Value) -> Result<Self> {
        let f: ConfigFile = typed(file, c)?;
        // transformers.BertConfig.__init__: vocab_size=30522, hidden_size=768,
        // num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
        // hidden_act="gelu", max_position_embeddings=512, type_vocab_size=2,
        // layer_norm_eps=1e-12, position_embedding_type="absolute"; is_decoder=False
        // (PretrainedConfig).
        let hidden = positive(file, "hidden_size", f.hidden_size.unwrap_or(768))?;
        let heads = positive(
            file,
            "num_attention_heads",
            f.num_attention_heads.unwrap_or(12),
        )?;
        if hidden % heads != 0 {
            return Err(field_error(
                file,
                "num_attention_heads",
                format!("hidden_size {hidden} does not split over {heads} attention heads"),
            ));
        }
        let gelu_tanh = match f.hidden_act.as_deref().unwrap_or("gelu") {
            "gelu" => false,
            "gelu_new" | "gelu_pytorch_tanh" => true,
            other => {
                return Err(field_error(
                    file,
                    "hidden_act",
                    format!("'{other}' is not supported (gelu, gelu_new, gelu_pytorch_tanh)"),
                ))
            }
        };
        match f.position_embedding_type.as_deref() {
            None | Some("absolute") => {}
            Some(other) => {
                return Err(field_error(
                    file,
                    "position_embedding_type",
                    format!("'{other}' is not supported (absolute)"),
                ))
            }
        }
        if f.is_decoder == Some(true) {
            return Err(field_error(
                file,
                "is_decoder",
                "a BERT decoder is not supported",
            ));
        }
        Ok(BertConfig {
            vocab: positive(file, "vocab_size", f.vocab_size.unwrap_or(30522))?,
            hidden,
            layers: positive(file, "num_hidden_layers", f.num_hidden_layers.unwrap_or(12))?,
            heads,
            intermediate: positive(
                file,
                "intermediate_size",
                f.intermediate_size.unwrap_or(3072),
            )?,
            max_positions: positive(
                file,
                "max_position_embeddings",
                f.max_position_embeddings.unwrap_or(512),
            )?,
            type_vocab: positive(file, "type_vocab_size", f.type_vocab_size.unwrap_or(2))?,
            eps: positive_f32(file, "layer_norm_eps", f.layer_norm_eps.unwrap_or(1e-12))?,
            gelu_tanh,
        })
    }

    /// Width of one head.
    pub fn head_dim(&self) -> usize {
        self.hidden / self.heads
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_refuses_what_the_graph_does_not_compute() {
        let c = serde_json::json!({
            "vocab_size": 10, "hidden_size": 8, "num_hidden_layers": 1,
            "num_attention_heads": 2, "intermediate_size": 16,
        });
        let ok = BertConfig::from_json("config.json", &c).expect("defaults");
        assert_eq!((ok.head_dim(), ok.eps, ok.gelu_tanh), (4, 1e-12, false));
        for (k, v, why) in [
            (
                "hidden_act",
                serde_json::json!("relu"),
                "hidden_act: 'relu'",
            ),
            (
                "position_embedding_type",
                serde_json::json!("relative_key"),
                "relative_key",
            ),
            (
                "num_attention_heads",
                serde_json::json!(3),
                "does not split",
            ),
            ("is_decoder", serde_json::json!(true), "decoder"),
            (
                "hidden_size",
                serde_json::json!("8"),
                "hidden_size: invalid type",
            ),
            ("layer_norm_eps", serde_json::json!(-1.0), "layer_norm_eps"),
            (
                "num_hidden_layers",
                serde_json::json!(-2),
                "num_hidden_layers",
            ),
        ] {
            let mut bad = c.clone();
            bad[k] = v;
            let e = BertConfig::from_json("m/config.json", &bad)
                .expect_err(k)
                .to_string();
            assert!(e.contains(why) && e.contains("m/config.json"), "{k}: {e}");
        }
    }
}
