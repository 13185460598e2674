//! `nibble run` for Flux-style DiTs: flow-matching Euler denoising, one streaming pass over the
//! blocks per step, per-step wall time / bytes / stall / RSS.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use nibble_core::backend::Backend;
use nibble_core::executor::{ExecOptions, Executor};
use nibble_core::graph::HostTensor;
use nibble_core::index::ModelIndex;
use nibble_core::models::dit;
use nibble_core::plan::{fmt_bytes, parse_size, Budgets};
use nibble_core::sampler::{flux_mu, FlowMatchEuler, Shift};
use serde_json::json;

/// Options of a DiT run.
#[derive(Debug, Clone)]
pub struct DitRun {
    /// Denoising steps.
    pub steps: usize,
    /// Inputs file (hidden_states, encoder_hidden_states, pooled_projections, guidance,
    /// img_ids, txt_ids); random from the seed otherwise.
    pub inputs: Option<std::path::PathBuf>,
    /// Seed of random inputs.
    pub seed: u64,
    /// Latent grid height (tokens), for random inputs.
    pub height: usize,
    /// Latent grid width (tokens), for random inputs.
    pub width: usize,
    /// Text tokens, for random inputs.
    pub text_len: usize,
    /// Guidance scale, for random inputs.
    pub guidance: f32,
    /// Static shift (1: none); ignored with dynamic shifting.
    pub shift: f64,
    /// Resolution-dependent shift (Flux).
    pub dynamic_shift: bool,
    /// Final latent output.
    pub out: Option<std::path::PathBuf>,
    /// PNG preview of the final latent.
    pub preview: Option<std::path::PathBuf>,
}

fn random(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            // Sum of four uniforms: roughly normal, mean 0, sd 1.
            let mut acc = 0.0;
            for _ in 0..4 {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                acc += (s >> 40) as f32 / (1u64 << 24) as f32;
            }
            (acc - 2.0) * 1.732
        })
        .collect()
}

/// Writes the first three channels of a latent `[h * w, c]` as an RGB PNG (each normalized).
fn write_preview(
    path: &std::path::Path,
    latent: &[f32],
    h: usize,
    w: usize,
    c: usize,
) -> Result<()> {
    let mut rgb = vec![0u8; h * w * 3];
    for ch in 0..3.min(c) {
        let vals: Vec<f32> = (0..h * w).map(|i| latent[i * c + ch]).collect();
        let (lo, hi) = vals
            .iter()
            .fold((f32::MAX, f32::MIN), |(a, b), &v| (a.min(v), b.max(v)));
        for (i, v) in vals.iter().enumerate() {
            rgb[i * 3 + ch] = (((v - lo) / (hi - lo).max(1e-12)) * 255.0).round() as u8;
        }
    }
    let f = std::fs::File::create(path).with_context(|| path.display().to_string())?;
    let mut enc = png::Encoder::new(std::io::BufWriter::new(f), w as u32, h as u32);
    enc.set_color(png::ColorType::Rgb);
    enc.set_depth(png::BitDepth::Eight);
    enc.write_header()?.write_image_data(&rgb)?;
    Ok(())
}

/// Runs the denoising loop on `backend`.
pub fn run<B: Backend>(
    o: &crate::run::RunOptions,
    d: &DitRun,
    model: &ModelIndex,
    backend: B,
    label: &str,
) -> Result<()> {
    let cfg = dit::DitConfig::from_json(model.config.as_ref().context("config.json")?)?;
    let (x0, ctx, pooled, guidance, img_ids, txt_ids) = match &d.inputs {
        Some(p) => {
            let f = ModelIndex::open(p)?;
            let get = |n: &str| -> Result<Vec<f32>> { Ok(f.read_f32(f.require(n)?)?) };
            let g = if cfg.guidance {
                get("guidance")?[0]
            } else {
                0.0
            };
            (
                get("hidden_states")?,
                get("encoder_hidden_states")?,
                get("pooled_projections")?,
                g,
                get("img_ids")?,
                get("txt_ids")?,
            )
        }
        None => {
            let n = d.height * d.width;
            let img: Vec<f32> = (0..n)
                .flat_map(|i| [0.0, (i / d.width) as f32, (i % d.width) as f32])
                .collect();
            (
                random(n * cfg.in_channels, d.seed),
                random(d.text_len * cfg.joint_dim, d.seed + 1),
                random(cfg.pooled_dim, d.seed + 2),
                d.guidance,
                img,
                vec![0.0; d.text_len * 3],
            )
        }
    };
    let (n, t) = (img_ids.len() / 3, txt_ids.len() / 3);
    if x0.len() != n * cfg.in_channels
        || ctx.len() != t * cfg.joint_dim
        || pooled.len() != cfg.pooled_dim
    {
        bail!(
            "inputs do not fit the model: {n} image tokens x {}, {t} text tokens x {}, pooled {}",
            cfg.in_channels,
            cfg.joint_dim,
            cfg.pooled_dim
        );
    }
    let dg = dit::build(model, n, t)?;
    let device_bytes = match &o.device_budget {
        Some(s) => parse_size(s)?,
        None => dg.graph.group_bytes(model)?.iter().sum::<u64>() + dg.graph.activation_bytes() * 2,
    };
    let budgets = Budgets {
        device_bytes,
        ring_slots: o.slots,
        slot_bytes: parse_size(&o.slot_size)?,
        host_cache_bytes: 0,
        device_other_bytes: 0,
        host_other_bytes: 0,
    };
    let mut ex = Executor::new(
        dg.graph,
        model,
        backend,
        ExecOptions {
            budgets,
            readers: 2,
            stream_all: o.stream_all,
        },
    )?;
    if !o.json {
        eprintln!("backend {label}");
        eprint!("{}", ex.plan().explain());
    }
    let ids: Vec<f32> = txt_ids.iter().chain(&img_ids).copied().collect();
    let (cos, sin) = cfg.rope_tables(&ids, 10000.0);
    let half = cfg.head_dim / 2;
    let shift = if d.dynamic_shift {
        Shift::Dynamic(flux_mu(n))
    } else {
        Shift::Static(d.shift)
    };
    let sigmas = FlowMatchEuler {
        num_train_timesteps: 1000,
        shift,
    }
    .sigmas(d.steps);
    let fixed = [
        HostTensor::f32(&[t, cfg.joint_dim], ctx)?,
        HostTensor::f32(&[1, cfg.pooled_dim], pooled)?,
    ];
    let (cos, sin) = (
        HostTensor::f32(&[t + n, half], cos)?,
        HostTensor::f32(&[t + n, half], sin)?,
    );
    let mut x = x0;
    let mut rows = Vec::with_capacity(d.steps);
    let t_all = Instant::now();
    for i in 0..d.steps {
        let ts = Instant::now();
        let mut inputs = vec![HostTensor::f32(&[n, cfg.in_channels], x.clone())?];
        inputs.extend(fixed.iter().cloned());
        inputs.push(HostTensor::f32(&[1], vec![sigmas[i] * 1000.0])?);
        if cfg.guidance {
            inputs.push(HostTensor::f32(&[1], vec![guidance * 1000.0])?);
        }
        inputs.push(cos.clone());
        inputs.push(sin.clone());
        let (out, stats) = ex.step(&inputs)?;
        FlowMatchEuler::step(&mut x, out[0].as_f32(), sigmas[i], sigmas[i + 1]);
        let wall = ts.elapsed().as_secs_f64() * 1e3;
        let rss = nibble_core::sys::rss_bytes().unwrap_or(0);
        if !o.json {
            eprintln!(
                "step {:>3}/{}  {:>9.1} ms  {:>10}  stall {:>7.1} ms  RSS {}",
                i + 1,
                d.steps,
                wall,
                fmt_bytes(stats.stream.bytes),
                stats.stream.stall.as_secs_f64() * 1e3,
                fmt_bytes(rss)
            );
        }
        rows.push(json!({"step": i + 1, "wall_ms": wall, "bytes_streamed": stats.stream.bytes, "stall_ms": stats.stream.stall.as_secs_f64() * 1e3, "rss_bytes": rss}));
    }
    if let Some(p) = &d.out {
        let bytes = nibble_core::convert::f32_to_bytes(&x);
        nibble_core::writer::write_safetensors(
            p,
            &[(
                "latent".into(),
                nibble_core::index::Dtype::F32,
                vec![1, n as u64, cfg.in_channels as u64],
                bytes,
            )],
            &Default::default(),
        )?;
    }
    if let Some(p) = &d.preview {
        let (h, w) = if d.inputs.is_none() {
            (d.height, d.width)
        } else {
            let h = img_ids.chunks(3).map(|r| r[1] as usize).max().unwrap_or(0) + 1;
            (h, n / h.max(1))
        };
        write_preview(p, &x, h, w, cfg.in_channels)?;
    }
    let total = t_all.elapsed().as_secs_f64();
    if o.json {
        let v = json!({"steps": rows, "summary": {"total_ms": total * 1e3, "ms_per_step": total * 1e3 / d.steps.max(1) as f64, "rss_max_bytes": nibble_core::sys::peak_rss_bytes()}});
        crate::write_stdout(&format!("{v}\n"))?;
    } else {
        eprintln!(
            "{} steps in {:.1} s ({:.1} ms/step)",
            d.steps,
            total,
            total * 1e3 / d.steps.max(1) as f64
        );
    }
    Ok(())
}
