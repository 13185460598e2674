//! Llama-family decoders (Llama, Mistral, Qwen2, SmolLM): the typed config, the graph with
//! prefill and decode programs over one KV cache, and the [`Decoder`] that runs it.

mod config;
mod decoder;
mod graph;

pub use config::{LlamaConfig, RopeScaling, MODEL_TYPES};
pub use decoder::Decoder;
pub use graph::{build, LlamaGraph, LlamaShape};
