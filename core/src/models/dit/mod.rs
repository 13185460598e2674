//! Flux-style diffusion transformers: the graph of diffusers' `FluxTransformer2DModel` and the
//! resumable denoising run (the shared denoise loop with flow-matching Euler) that `nibble run`,
//! the demo and the browser share.

mod config;
mod denoise;
mod graph;

pub use config::DitConfig;
pub use denoise::{gaussian_like, schedule, DenoiseStep, Denoiser, DitInputs, FluxTransformer};
#[cfg(feature = "native")]
pub use denoise::{Checkpoint, CHECKPOINT_FILE};
pub use graph::{build, DitGraph};
