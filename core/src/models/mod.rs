//! Model graph builders on the core graph.

pub mod llama;
