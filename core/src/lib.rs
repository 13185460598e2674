//! nibble-core: the parts of nibble with no GPU dependency (it compiles to wasm32). Layers, each a
//! folder, imports pointing down only:
//!
//! - [`models`]: model configs, graphs and their runtime loops (token generation and sampling,
//!   denoising and its schedule, sentence embeddings), and text (tokenizers, chat templates).
//! - [`exec`]: the step loop, and loading weight chunks from ring slots into the weight pool.
//! - [`plan`]: budgets in, [`plan::MemoryPlan`] and the arena / pool layout out, from one
//!   function; what the machine has.
//! - [`backend`]: the small [`backend::Backend`] trait and its optional capability, the
//!   kernel-call table the GPU backends share, the `cpu_ref` oracle and the optimized `cpu`
//!   backend.
//! - [`graph`]: ops as data, shapes, the [`graph::Graph`] builder.
//! - [`stream`]: the staging ring and the prefetcher.
//! - [`io`]: byte sources (file, HTTP), [`io::model::ModelIndex`] and the one routine that opens
//!   a model from a local folder, an HTTP base URL or the browser's fetch.
//! - [`format`]: safetensors headers, the bitsandbytes 4-bit format and its quantizer, GGUF,
//!   the safetensors writer, dtype conversions.
//!
//! [`error`] is shared by all of them. [`tooling`] (synthetic models, fuzz entry points) is
//! behind the `tooling` feature and no product code imports it.

pub mod backend;
pub mod error;
pub mod exec;
pub mod format;
pub mod graph;
pub mod io;
pub mod models;
pub mod plan;
pub mod stream;
#[cfg(feature = "tooling")]
pub mod tooling;

pub use error::{Error, QuantProblem, Result};
