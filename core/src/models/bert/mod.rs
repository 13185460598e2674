//! BERT encoders (transformers' `BertModel`, sentence-transformers models): the post-norm
//! encoder graph, sentence-transformers pooling, and the [`Encoder`] that runs it.

mod graph;

pub use graph::{build, config, BertConfig, BertGraph, Encoder, Pooling, PoolingMode};
