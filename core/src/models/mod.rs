//! Model graph builders on the core graph.

pub mod dit;
pub mod llama;
