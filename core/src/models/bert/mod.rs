//! BERT encoders (transformers' `BertModel`, sentence-transformers models): the typed config, the
//! post-norm encoder graph, sentence-transformers pooling, and the [`Encoder`] that runs it.

mod config;
mod encoder;
mod graph;
mod pooling;

pub use config::BertConfig;
pub use encoder::Encoder;
pub use graph::{build, BertGraph};
pub use pooling::{max_seq_len, Pooling, PoolingMode};
