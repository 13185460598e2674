//! `nibble synth`: deterministic synthetic NF4 models in the real transformers / diffusers
//! layouts (benchmarks, tests, the demo).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};
use nibble_core::plan::fmt_bytes;
use nibble_core::tooling::synth::{Arch, SynthModel};

use crate::args::size;

/// Which architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SynthArch {
    /// transformers' LlamaForCausalLM.
    Llama,
    /// diffusers' Flux-style DiT.
    Dit,
}

/// Options of `nibble synth`.
#[derive(Debug, Clone, Args)]
pub struct SynthArgs {
    /// The architecture.
    #[arg(long, value_enum)]
    pub arch: SynthArch,
    /// Approximate size on disk, e.g. 1GiB, 256MiB.
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub size: u64,
    /// Output folder.
    #[arg(short, long)]
    pub out: PathBuf,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Writes the model, with progress on stderr.
pub fn run(a: &SynthArgs) -> Result<()> {
    let arch = match a.arch {
        SynthArch::Llama => Arch::Llama,
        SynthArch::Dit => Arch::Dit,
    };
    let m = SynthModel::new(arch, a.size, a.seed);
    let total = m.tensor_bytes();
    eprintln!(
        "writing {} of tensors to {}",
        fmt_bytes(total),
        a.out.display()
    );
    let mut last = 0u64;
    let files = m.write(&a.out, |done, total| {
        if done - last >= 64 << 20 || done == total {
            eprint!(
                "\r  {:>5.1}%  {} / {}",
                done as f64 * 100.0 / total.max(1) as f64,
                fmt_bytes(done),
                fmt_bytes(total)
            );
            last = done;
        }
    })?;
    eprintln!();
    eprintln!(
        "wrote config.json and {} file(s): {}",
        files.len(),
        files.join(", ")
    );
    Ok(())
}
