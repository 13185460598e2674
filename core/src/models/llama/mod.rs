//! Llama-family decoders (Llama, Mistral, Qwen2, SmolLM): the typed config, the graph with
//! prefill and decode programs over one KV cache, the [`Decoder`] that runs it, and the one
//! token-generation loop ([`Generation`], [`Sampler`], [`eos_ids`]) every front end uses, and the
//! continuous-batching engine a server runs ([`engine`], with the `text` feature).

mod batch;
mod config;
mod decoder;
#[cfg(feature = "text")]
pub mod engine;
mod generate;
mod graph;

pub use batch::{build_batched, BatchDecoder, BatchGraph, BatchShape};
pub use config::{LlamaConfig, RopeScaling, MODEL_TYPES};
pub use decoder::Decoder;
pub use generate::{eos_ids, Finish, GenerateOptions, Generation, Sampler, Sampling, Token};
pub use graph::{build, LlamaGraph, LlamaShape};
