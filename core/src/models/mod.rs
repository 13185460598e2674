//! The models layer: each model kind in its own folder with its typed config, its graph and its
//! runtime loop (Llama-family decoders with the token-generation loop and sampler, BERT encoders
//! with sentence-transformers pooling, Flux-style DiTs with the denoising loop and the
//! flow-matching schedule, CLIP's text model, T5's encoder and the VAE decoder, the Flux
//! pipeline's scheduler, noise and latent packing), the helpers their graphs share, and text (tokenizers, chat
//! templates).
//!
//! Owns: what a model is and how a run of it proceeds, step by step.
//! May import: `exec`, `plan`, `backend`, `graph`, `stream`, `io`, `format`, `error`.

pub mod bert;
pub mod clip;
pub mod component;
pub mod denoise;
pub mod dit;
pub mod flux;
pub mod llama;
pub mod lora;
pub mod nn;
pub mod pipeline;
pub mod scheduler;
pub mod t5;
#[cfg(feature = "text")]
pub mod text;
pub mod vae;
pub mod wan;

use crate::error::Result;
use crate::io::model::ModelIndex;
pub(crate) use nn::{reshape, swap01, W};

/// What a model folder holds, by its `config.json`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModelKind {
    /// A decoder-only language model ([`llama`]).
    Llm,
    /// A Flux-style diffusion transformer ([`dit`]).
    Dit,
    /// A BERT encoder ([`bert`]): token states and sentence embeddings.
    Encoder,
}

impl ModelKind {
    /// An `*ForCausalLM` architecture or a Llama-family `model_type` is a language model;
    /// diffusers' Flux config (`num_single_layers`, `joint_attention_dim`) a DiT; `BertModel`
    /// or `model_type: bert` an encoder.
    pub fn of_config(c: &serde_json::Value) -> Option<Self> {
        let causal = c
            .get("architectures")
            .and_then(|a| a.as_array())
            .is_some_and(|a| {
                a.iter()
                    .any(|x| x.as_str().is_some_and(|s| s.ends_with("ForCausalLM")))
            });
        let family = c
            .get("model_type")
            .and_then(|m| m.as_str())
            .is_some_and(|m| llama::MODEL_TYPES.contains(&m));
        let bert = c.get("model_type").and_then(|m| m.as_str()) == Some("bert")
            || c.get("architectures")
                .and_then(|a| a.as_array())
                .is_some_and(|a| a.iter().any(|x| x.as_str() == Some("BertModel")));
        if bert {
            Some(ModelKind::Encoder)
        } else if causal || family {
            Some(ModelKind::Llm)
        } else if c.get("num_single_layers").is_some() && c.get("joint_attention_dim").is_some() {
            Some(ModelKind::Dit)
        } else {
            None
        }
    }
}

/// Checks that the model holds block `prefix` (some tensor named `prefix.*`) before the graph
/// declares it: a block count in config.json is checked against the file as the graph is built,
/// so that a count no file backs (1e18 layers) fails at the first missing block instead of
/// running on.
pub(crate) fn require_block(
    model: &ModelIndex,
    prefix: &str,
    field: &str,
    count: usize,
) -> Result<()> {
    let dotted = format!("{prefix}.");
    if model.tensors().any(|t| t.name.starts_with(&dotted)) {
        return Ok(());
    }
    Err(crate::Error::Model {
        file: model.locate("config.json"),
        msg: format!("{field} is {count}, but the model has no tensor of {prefix}"),
    })
}

/// The model's `config.json` typed as `T`, and its location for messages.
pub(crate) fn typed_config<T: serde::de::DeserializeOwned>(
    model: &ModelIndex,
    what: &str,
) -> Result<(String, T)> {
    let file = model.locate("config.json");
    let json = model.config.as_ref().ok_or_else(|| crate::Error::Model {
        file: file.clone(),
        msg: format!("not found: {what} needs its config.json"),
    })?;
    let t = crate::format::json::typed(&file, json)?;
    Ok((file, t))
}

/// A maker of weight sources for one model (the browser's fetch sources).
pub type SourceMaker = Box<dyn FnMut() -> Box<dyn crate::io::source::ByteSource>>;

/// How a phase reads its weights and waits for its results.
pub enum Drive<'a> {
    /// Native: reader threads read the weights; reads and results are waited for.
    Blocking,
    /// An event loop (the browser): each model's weights come from the sources the maker
    /// gives for it, and reads and read-backs are awaited, never waited for.
    EventLoop(&'a dyn Fn(&ModelIndex) -> SourceMaker),
}

impl std::fmt::Debug for Drive<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Drive::Blocking => "Blocking",
            Drive::EventLoop(_) => "EventLoop",
        })
    }
}
