//! `nibble synth`: deterministic synthetic NF4 models in the real transformers / diffusers
//! layouts (benchmarks, tests, the demo).

use std::path::PathBuf;

use anyhow::Result;
use clap::{Args, ValueEnum};
use nibble_core::plan::fmt_bytes;
use nibble_core::tooling::synth::{Arch, SynthModel};

use crate::args::synth_size;
use crate::output::folder;

/// Which architecture.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SynthArch {
    /// transformers' LlamaForCausalLM.
    Llama,
    /// diffusers' Flux-style DiT.
    Dit,
    /// A diffusers Wan 2.1 pipeline folder (WanPipeline: umT5, the 3D transformer, the video
    /// VAE); --size sizes the transformer, --shape gives a real repo's shapes.
    Wan,
    /// A diffusers Flux pipeline folder (FluxPipeline: CLIP, a 4-bit T5, the DiT, the VAE), the
    /// demo's; --size sizes the transformer (154 MiB or more).
    Flux,
}

/// A real repo's shapes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum SynthShape {
    /// Wan-AI/Wan2.1-T2V-1.3B-Diffusers.
    #[value(name = "1.3b")]
    Wan1_3b,
    /// Wan-AI/Wan2.1-T2V-14B-Diffusers.
    #[value(name = "14b")]
    Wan14b,
}

/// Options of `nibble synth`.
#[derive(Debug, Clone, Args)]
pub struct SynthArgs {
    /// The architecture.
    #[arg(long, value_enum)]
    pub arch: SynthArch,
    /// Approximate size on disk, e.g. 1GiB, 256MiB (a Wan folder: its transformer's), 1 MiB to
    /// 4 TiB.
    #[arg(long, value_parser = synth_size, value_name = "SIZE", required_unless_present = "shape")]
    pub size: Option<u64>,
    /// A Wan folder of a real repo's shapes and configs (instead of --size).
    #[arg(long, value_enum, conflicts_with = "size")]
    pub shape: Option<SynthShape>,
    /// Output folder.
    #[arg(short, long)]
    pub out: PathBuf,
    /// A Wan folder's VAE base_dim [default: 96, Wan 2.1's] (smaller: a cheaper decoder of the
    /// same layout, for benchmarks).
    #[arg(long, value_name = "N")]
    pub vae_base_dim: Option<u64>,
    /// Seed of the weights.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
}

/// Writes the model, with progress on stderr.
pub fn run(a: &SynthArgs) -> Result<()> {
    let arch = match (a.arch, a.size) {
        (SynthArch::Wan, _) => return wan(a),
        _ if a.vae_base_dim.is_some() => anyhow::bail!("--vae-base-dim is for --arch wan"),
        (_, None) => anyhow::bail!("--shape is for --arch wan; give --size"),
        (SynthArch::Flux, Some(s)) => return flux(a, s),
        (SynthArch::Llama, Some(s)) => (Arch::Llama, s),
        (SynthArch::Dit, Some(s)) => (Arch::Dit, s),
    };
    // Checked before the model's tensors are even listed: 50 TiB is refused in no time.
    folder::check_room(&a.out, arch.1, "--out")?;
    folder::prepare(&a.out, "--out")?;
    let m = SynthModel::new(arch.0, arch.1, a.seed);
    folder::check_room(&a.out, m.tensor_bytes(), "--out")?;
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
    folder::seal(&a.out, "nibble synth")?;
    eprintln!(
        "wrote config.json and {} file(s): {}",
        files.len(),
        files.join(", ")
    );
    Ok(())
}

/// A Wan folder: its shapes, then each component's progress.
fn wan(a: &SynthArgs) -> Result<()> {
    use nibble_core::tooling::synth_wan::{tensor_bytes, write_pipeline, WanSynthShape};
    let shape = match (a.shape, a.size) {
        (Some(SynthShape::Wan1_3b), _) => WanSynthShape::real_1_3b(),
        (Some(SynthShape::Wan14b), _) => WanSynthShape::real_14b(),
        (None, Some(s)) => WanSynthShape::scaled(s),
        (None, None) => anyhow::bail!("give --size or --shape"),
    };
    let shape = WanSynthShape {
        vae_base_dim: a.vae_base_dim.unwrap_or(shape.vae_base_dim),
        ..shape
    };
    if shape.vae_base_dim == 0 || !shape.vae_base_dim.is_multiple_of(2) {
        anyhow::bail!(
            "--vae-base-dim {}: an even number above 0",
            shape.vae_base_dim
        );
    }
    eprintln!(
        "writing a Wan folder to {}: transformer {} blocks of {}, umT5 {} layers, VAE base {}; \
         {} of tensors",
        a.out.display(),
        shape.layers,
        shape.dim,
        shape.text_layers,
        shape.vae_base_dim,
        fmt_bytes(tensor_bytes(shape))
    );
    folder::check_room(&a.out, tensor_bytes(shape), "--out")?;
    folder::prepare(&a.out, "--out")?;
    write_pipeline(&a.out, shape, a.seed, component_progress())?;
    folder::seal(&a.out, "nibble synth --arch wan")?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// A Flux pipeline folder of the demo's shapes with a transformer of `size`.
fn flux(a: &SynthArgs, size: u64) -> Result<()> {
    use nibble_core::tooling::synth_flux::{components, write_pipeline, FluxSynthShape};
    // The folder's encoders are CLIP-L and T5-XXL wide: the transformer must take 768- and
    // 4096-wide states, which the narrowest synthetic DiTs do not.
    let fits = |s: u64| {
        let c = SynthModel::new(Arch::Dit, s, a.seed).config;
        c["joint_attention_dim"] == 4096 && c["pooled_projection_dim"] == 768
    };
    if !fits(size) {
        let (mut lo, mut hi) = (size >> 20, 1u64 << 22);
        while lo + 1 < hi {
            let mid = (lo + hi) / 2;
            if fits(mid << 20) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        anyhow::bail!(
            "--size {}: a Flux folder's transformer needs {hi} MiB or more (a width that takes \
             CLIP-L's 768-wide and T5-XXL's 4096-wide states)",
            fmt_bytes(size)
        );
    }
    let shape = FluxSynthShape {
        dit_bytes: size,
        ..Default::default()
    };
    let total: u64 = components(shape, a.seed)
        .iter()
        .map(|(_, m)| m.tensor_bytes())
        .sum();
    eprintln!(
        "writing a Flux folder to {}: {} of tensors",
        a.out.display(),
        fmt_bytes(total)
    );
    folder::check_room(&a.out, total, "--out")?;
    folder::prepare(&a.out, "--out")?;
    write_pipeline(&a.out, shape, a.seed, component_progress())?;
    folder::seal(&a.out, "nibble synth --arch flux")?;
    eprintln!("wrote {}", a.out.display());
    Ok(())
}

/// Progress of a pipeline's components on stderr, a line each.
fn component_progress() -> impl FnMut(&str, u64, u64) {
    let mut last = (String::new(), 0u64);
    move |name, done, total| {
        if name != last.0 || done - last.1 >= 64 << 20 || done == total {
            eprint!(
                "\r  {name:<14} {:>5.1}%  {} / {}   ",
                done as f64 * 100.0 / total.max(1) as f64,
                fmt_bytes(done),
                fmt_bytes(total)
            );
            if done == total {
                eprintln!();
            }
            last = (name.to_string(), done);
        }
    }
}
