//! The format layer: what bytes mean. safetensors headers, the bitsandbytes 4-bit format (code
//! tables, quant states, bit-exact dequantization) and its quantizer, llama.cpp's GGUF and the
//! converter from it, the streaming safetensors writer, dtype conversions, and sizes for people
//! (binary units in and out).
//!
//! Owns: parsing and producing file contents, checked against what the bytes hold.
//! May import: `error` only (and std's file API for the writer and GGUF reader, natively).

pub mod bnb;
pub mod dtype;
#[cfg(feature = "native")]
pub mod gguf;
#[cfg(all(feature = "native", feature = "text"))]
pub mod gguf_convert;
pub mod json;
pub mod lora;
#[cfg(feature = "native")]
pub mod positional;
pub mod quantize;
pub mod safetensors;
pub mod size;
pub mod writer;
