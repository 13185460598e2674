//! nibble-core: the parts of nibble with no GPU dependency (compiles to wasm32).
//!
//! - [`index`]: safetensors headers and model folders, validated against file lengths.
//! - [`bnb`]: the bitsandbytes NF4/FP4 format and its bit-exact reference dequantization.
//! - [`quantize`]: the bitsandbytes quantizer, bit for bit.
//! - [`cpu_ref`]: the reference backend's ops.
//! - [`writer`]: streaming safetensors writer.

pub mod backend;
pub mod bnb;
pub mod convert;
pub mod cpu;
pub mod cpu_ref;
pub mod dequant_fast;
pub mod error;
pub mod executor;
#[cfg(feature = "native")]
pub mod file_source;
pub mod fuzzing;
#[cfg(feature = "native")]
pub mod gguf;
#[cfg(all(feature = "native", feature = "text"))]
pub mod gguf_convert;
pub mod graph;
#[cfg(feature = "native")]
pub mod http_source;
pub mod index;
pub mod kernels;
pub mod models;
pub mod pipeline;
pub mod plan;
pub mod prefetch;
pub mod quantize;
pub mod ring;
pub mod sampler;
pub mod source;
#[cfg(feature = "native")]
pub mod synth;
pub mod sys;
#[cfg(feature = "text")]
pub mod text;
pub mod writer;

pub use error::{Error, QuantProblem, Result};
