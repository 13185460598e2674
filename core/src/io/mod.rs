//! The io layer: where bytes come from. Positional range reads ([`source::RangeSource`]: local
//! files, HTTP Range requests) and the submit/complete interface the prefetcher drives
//! ([`source::ByteSource`]); [`model::ModelIndex`], a model's tensors by name with their byte
//! ranges, and the routine that opens one; what the machine has ([`machine`]: available memory,
//! this process's RSS).
//!
//! Owns: reading, and refusing reads that a file's index does not allow.
//! May import: `format`, `error`.

#[cfg(feature = "native")]
pub mod file;
pub mod folder;
#[cfg(feature = "native")]
pub mod http;
pub mod machine;
pub mod model;
pub mod source;
