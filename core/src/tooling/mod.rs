//! Tooling, behind the `tooling` feature: deterministic synthetic models in the real on-disk
//! layouts (benchmarks, tests, the demo) and the entry points the fuzz targets share. Product
//! code in this crate does not import it.
//!
//! Owns: synthetic models and fuzzing entry points.
//! May import: `format`, `io`, `error`.

pub mod fuzzing;
pub mod synth;
pub mod synth_flux;
pub mod synth_wan;
