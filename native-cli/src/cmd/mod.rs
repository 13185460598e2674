//! The subcommands, one module each; `main.rs` is the clap tree and the dispatch.

pub mod bench;
pub mod demo;
pub mod inspect;
pub mod quant;
pub mod run;
pub mod serve;
pub mod synth;
