//! Llama-family decoders (Llama, Mistral, Qwen2, SmolLM): the graph with prefill and decode
//! programs over one KV cache, and the [`Decoder`] that runs it.

mod graph;

pub use graph::{
    build, config, Decoder, LlamaConfig, LlamaGraph, LlamaShape, RopeScaling, MODEL_TYPES,
};
