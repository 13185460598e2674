//! Flux-style diffusion transformers: the graph of diffusers' `FluxTransformer2DModel`, the
//! flow-matching Euler schedule, and the resumable denoising loop that `nibble run`, the demo and
//! the browser share.

mod config;
mod denoise;
mod graph;
mod schedule;

pub use config::DitConfig;
pub use denoise::{gaussian_like, schedule, DenoiseStep, Denoiser, DitInputs};
#[cfg(feature = "native")]
pub use denoise::{Checkpoint, CHECKPOINT_FILE};
pub use graph::{build, DitGraph};
pub use schedule::{flux_mu, FlowMatchEuler, Shift};
