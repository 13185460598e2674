//! Wan 2.1 (text to video), the second diffusion family on the family-neutral layer: the
//! transformer's typed config ([`WanConfig`]), its graph ([`build`]: both guidance sequences
//! through one pass over the weights) and the transformer as a [`crate::models::denoise`]
//! model ([`WanTransformer`]: patches, 3D rotary tables, guidance). Its text encoder is umT5
//! ([`crate::models::t5::UmT5Encoder`]) and its sampler UniPC
//! ([`crate::models::scheduler::UniPc`]).

pub mod checkpoint;
mod config;
mod graph;
pub mod lora;
#[cfg(feature = "text")]
pub mod pipeline;
#[cfg(feature = "text")]
pub mod text;
pub mod tiling;
mod transformer;
pub mod vae;

pub use checkpoint::WanCheckpoint;
pub use config::WanConfig;
pub use graph::{build, WanGraph};
pub use tiling::WanTiling;
pub use transformer::{patch_grid, patchify, rope_tables, unpatchify, WanTransformer};
pub use vae::{WanVaeConfig, WanVaeDecoder};
