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
pub mod dit;
pub mod flux;
pub mod llama;
pub mod t5;
#[cfg(feature = "text")]
pub mod text;
pub mod vae;

use crate::error::Result;
use crate::graph::{Graph, ValueId, WeightId};
use crate::graph::{OpKind, Q4Info};
use crate::io::model::ModelIndex;

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

/// A projection's weight in a graph: 4-bit where the checkpoint quantized it, dense otherwise;
/// with its bias where the checkpoint has one.
#[derive(Debug, Clone, Copy)]
pub(crate) enum W {
    Q4(WeightId, Option<ValueId>),
    Dense(ValueId, Option<ValueId>),
}

impl W {
    /// The weight `name` (`[out, inp]`) of group `grp`, and `<name without .weight>.bias`.
    pub(crate) fn load(
        g: &mut Graph,
        model: &ModelIndex,
        grp: usize,
        name: &str,
        out: usize,
        inp: usize,
    ) -> Result<W> {
        let bias_name = format!("{}.bias", name.trim_end_matches(".weight"));
        let bias = model
            .get(&bias_name)
            .map(|_| g.dense_weight(grp, &bias_name, &[out]));
        if let Some(k) = model.q4_key(name)? {
            let s = model.quant_state_json(k)?;
            let info = Q4Info {
                shape: vec![out, inp],
                blocksize: s.blocksize as usize,
            };
            Ok(W::Q4(g.q4_weight(grp, name, info), bias))
        } else {
            Ok(W::Dense(g.dense_weight(grp, name, &[out, inp]), bias))
        }
    }

    /// `x · Wᵀ (+ b)`.
    pub(crate) fn apply(self, g: &mut Graph, x: ValueId) -> Result<ValueId> {
        match self {
            W::Q4(w, None) => g.op(OpKind::LinearQ4 { bias: false }, &[x], Some(w)),
            W::Q4(w, Some(b)) => g.op(OpKind::LinearQ4 { bias: true }, &[x, b], Some(w)),
            W::Dense(w, None) => g.op(OpKind::Linear { bias: false }, &[x, w], None),
            W::Dense(w, Some(b)) => g.op(OpKind::Linear { bias: true }, &[x, w, b], None),
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

/// The same data in another shape.
pub(crate) fn reshape(g: &mut Graph, x: ValueId, shape: &[usize]) -> Result<ValueId> {
    g.op(
        OpKind::Reshape {
            shape: shape.to_vec(),
        },
        &[x],
        None,
    )
}

/// `[a, b, c]` to `[b, a, c]` (tokens x heads to heads x tokens and back).
pub(crate) fn swap01(g: &mut Graph, x: ValueId) -> Result<ValueId> {
    g.op(
        OpKind::Permute {
            perm: vec![1, 0, 2],
        },
        &[x],
        None,
    )
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

/// A model's graph bound to a backend, with one output: the runner the encoders and the VAE
/// share.
pub(crate) struct Runner<B: crate::backend::Backend> {
    pub(crate) ex: crate::exec::Executor<B>,
    event_loop: bool,
}

impl<B: crate::backend::Backend> Runner<B> {
    /// Plans, allocates and loads the resident weights of `graph`, as `drive` says.
    pub(crate) async fn open(
        graph: Graph,
        model: &ModelIndex,
        backend: B,
        opts: crate::exec::ExecOptions,
        drive: &Drive<'_>,
    ) -> Result<Self> {
        let ex = match drive {
            Drive::Blocking => crate::exec::Executor::new(graph, model, backend, opts)?,
            Drive::EventLoop(maker) => {
                let mut make = maker(model);
                crate::exec::Executor::with_source_async(graph, model, backend, opts, &mut make)
                    .await?
            }
        };
        Ok(Runner {
            ex,
            event_loop: matches!(drive, Drive::EventLoop(_)),
        })
    }

    /// One step with `inputs`: the output, checked finite (`what` names it in the error).
    pub(crate) async fn run(
        &mut self,
        inputs: &[crate::graph::HostTensor],
        what: &str,
    ) -> Result<(Vec<f32>, crate::exec::ExecStats)> {
        let (out, stats) = if self.event_loop {
            self.ex.step_program_async(0, inputs).await?
        } else {
            self.ex.step(inputs)?
        };
        let v = out
            .into_iter()
            .next()
            .ok_or_else(|| crate::Error::Invalid(format!("{what}: the graph has no output")))?
            .into_f32();
        crate::error::check_finite(&v, || what.to_string())?;
        Ok((v, stats))
    }

    /// The backend back, its device memory released (for the next phase).
    pub(crate) fn into_backend(self) -> B {
        self.ex.into_parts().0
    }
}
