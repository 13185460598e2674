//! The stream layer: the staging ring (N slots of S bytes, allocated once; a slot is reused only
//! after the fence of the upload that read it) and the prefetcher that keeps reads in flight into
//! it in schedule order.
//!
//! Owns: the bounded pipeline from a [`crate::io::source::ByteSource`] to the executor.
//! May import: `io`, `format`, `error`.

pub mod host_tier;
pub mod prefetch;
pub mod ring;
