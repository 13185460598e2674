//! `nibble demo`: the situation nibble exists for, on a built-in default. A two-phase diffusion
//! pipeline as real ones run it: a Llama-style text encoder turns the prompt into hidden states,
//! then a ~1.5 GiB NF4 Flux-style DiT denoises for 50 steps with a device budget far below its
//! size, every block streamed through a fixed ring each step. Both phases are planned before the
//! first byte is read and share the backend and the ring; the text encoder's device memory is
//! released before the DiT phase allocates. Per step: wall time, bytes streamed, stall, RSS; at
//! the end a summary, the latent, a preview and a chart of RSS and step time against step.
//!
//! The models are synthetic (deterministic from the seed, written once into a cache folder): the
//! point is memory and streaming behaviour, not the picture.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use nibble_core::backend::Backend;
use nibble_core::exec::{ExecOptions, Executor};
use nibble_core::io::model::ModelIndex;
use nibble_core::models::dit::DitConfig;
use nibble_core::models::dit::{schedule, Checkpoint, Denoiser, DitInputs};
use nibble_core::models::llama::{self, Decoder, LlamaShape};
use nibble_core::plan::{fmt_bytes, Budgets};
use nibble_core::tooling::synth::{Arch, LlamaSynthShape, SynthModel};
use serde_json::json;

use crate::args::{size, BackendArg};

/// Options of `nibble demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Denoising steps.
    #[arg(long, default_value_t = 50)]
    pub steps: usize,
    /// Latent grid height in tokens.
    #[arg(long, default_value_t = 8)]
    pub height: usize,
    /// Latent grid width in tokens.
    #[arg(long, default_value_t = 8)]
    pub width: usize,
    /// Text tokens.
    #[arg(long, default_value_t = 16)]
    pub text_len: usize,
    /// The prompt (its bytes become the synthetic encoder's token ids).
    #[arg(long, default_value = "a lighthouse on a cliff at dusk, oil on canvas")]
    pub prompt: String,
    /// Size of the synthetic DiT on disk.
    #[arg(long, value_parser = size, default_value = "1800MiB", value_name = "SIZE")]
    pub dit_size: u64,
    /// Seed of the models and the noise.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Device memory for each phase.
    #[arg(long, value_parser = size, default_value = "512MiB", value_name = "SIZE")]
    pub device_budget: u64,
    /// Ring slots.
    #[arg(long, default_value_t = 4)]
    pub slots: u64,
    /// Bytes per ring slot.
    #[arg(long, value_parser = size, default_value = "32MiB", value_name = "SIZE")]
    pub slot_size: u64,
    /// Backend that runs the ops.
    #[arg(long, value_enum, default_value_t)]
    pub backend: BackendArg,
    /// Where the chart, latent, preview and per-step figures go.
    #[arg(long, default_value = "nibble-demo")]
    pub out_dir: PathBuf,
    /// Where the synthetic models are kept (default $NIBBLE_CACHE or ~/.cache/nibble).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Write the DiT latent and step index here after every step (atomically).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// Continue the DiT phase from the checkpoint in this folder.
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

fn cache_root(o: &DemoArgs) -> PathBuf {
    o.cache_dir
        .clone()
        .or_else(|| std::env::var_os("NIBBLE_CACHE").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/nibble")))
        .unwrap_or_else(|| PathBuf::from(".nibble-cache"))
        .join("demo")
}

/// Writes `m` into `dir` once: into `dir.partial`, renamed when complete, reused afterwards.
fn ensure_model(dir: &Path, what: &str, m: &SynthModel, quiet: bool) -> Result<()> {
    if dir.join("config.json").is_file() {
        return Ok(());
    }
    let partial = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    if !quiet {
        eprintln!(
            "writing the {what} ({}) into {} (once; reused later)",
            fmt_bytes(m.tensor_bytes()),
            dir.display()
        );
    }
    let t = Instant::now();
    let mut last = 0u64;
    m.write(&partial, |done, total| {
        if !quiet && (done - last >= 256 << 20 || done == total) {
            eprintln!(
                "  {:>5.1}%  {} / {}",
                done as f64 * 100.0 / total.max(1) as f64,
                fmt_bytes(done),
                fmt_bytes(total)
            );
            last = done;
        }
    })?;
    std::fs::rename(&partial, dir).with_context(|| format!("renaming into {}", dir.display()))?;
    if !quiet {
        eprintln!("  done in {:.1} s", t.elapsed().as_secs_f64());
    }
    Ok(())
}

/// The synthetic text encoder for a DiT: a Llama-style decoder as wide as the DiT's text input.
fn encoder_shape(joint_dim: usize) -> LlamaSynthShape {
    let hidden = joint_dim as u64;
    let heads = (hidden / 128).max(1);
    LlamaSynthShape {
        hidden,
        intermediate: 2 * hidden,
        heads,
        kv_heads: (heads / 4).max(1),
        // Prompt bytes plus a few specials.
        vocab: 512,
        layers: 2,
        tied: true,
    }
}

/// The prompt's token ids for the synthetic encoder: UTF-8 bytes (offset past the specials),
/// padded with 0 or cut to `len`.
fn prompt_ids(prompt: &str, len: usize) -> Vec<u32> {
    let mut ids: Vec<u32> = prompt.bytes().map(|b| b as u32 + 3).take(len).collect();
    ids.resize(len, 0);
    ids
}

struct Demo<'a> {
    o: &'a DemoArgs,
    dit: &'a ModelIndex,
    encoder: &'a ModelIndex,
}

fn bar(done: usize, total: usize) -> String {
    let w = 24;
    let filled = (done * w).div_ceil(total.max(1)).min(w);
    format!("[{}{}]", "#".repeat(filled), "-".repeat(w - filled))
}

fn phase_peak() -> u64 {
    nibble_core::io::machine::peak_rss_bytes().unwrap_or(0)
}

impl crate::backends::WithBackend for Demo<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, mut backend: B, label: &str) -> Result<()> {
        let Demo { o, dit, encoder } = self;
        let quiet = o.json;
        let dcfg = DitConfig::of(dit)?;
        let budgets = Budgets {
            device_bytes: o.device_budget,
            ring_slots: o.slots,
            slot_bytes: o.slot_size,
        };
        let opts = ExecOptions {
            budgets,
            readers: 2,
            stream_all: false,
            naive: false,
        };
        // Both phases planned before anything is read or allocated.
        let t_len = o.text_len.max(1);
        let lshape = LlamaShape {
            prompt: t_len,
            capacity: t_len,
            all_logits: false,
            hidden_states: true,
        };
        let lg = llama::build(encoder, lshape)?;
        let enc_plan = Executor::plan_only(&lg.graph, encoder, &mut backend, opts)
            .context("planning the text-encoder phase")?;
        let placeholder = DitInputs::random(&dcfg, o.height, o.width, t_len, 3.5, o.seed)?;
        let dit_graph = Denoiser::<B>::graph_for(dit, &placeholder)?;
        let dit_plan = Executor::plan_only(&dit_graph, dit, &mut backend, opts)
            .context("planning the DiT phase")?;
        drop(dit_graph);
        if !quiet {
            eprintln!("backend {label}");
            eprintln!("phase 1, text encoder ({}):", encoder.root);
            eprint!("{}", enc_plan.explain());
            eprintln!("phase 2, DiT ({}):", dit.root);
            eprint!("{}", dit_plan.explain());
        }

        // Phase 1: the prompt through the text encoder.
        nibble_core::io::machine::reset_peak_rss();
        let t1 = Instant::now();
        let mut dec = Decoder::from_graph(lg, encoder, backend, opts)?;
        let ids = prompt_ids(&o.prompt, t_len);
        let (hidden, enc_stats) = dec.prefill(&ids)?;
        let enc_ms = t1.elapsed().as_secs_f64() * 1e3;
        let enc_alloc = dec.executor().plan().peak_device_bytes;
        let (backend, ring) = dec.into_parts();
        let enc_peak = phase_peak();
        if !quiet {
            eprintln!(
                "phase 1 done: {t_len} tokens encoded in {enc_ms:.0} ms, {} streamed, peak RSS {} (device {} released)",
                fmt_bytes(enc_stats.stream.bytes),
                fmt_bytes(enc_peak),
                fmt_bytes(enc_alloc)
            );
        }
        // The encoder's last hidden states are the DiT's text input; the pooled embedding is
        // their mean over tokens, cut to the DiT's width.
        let h = dcfg.joint_dim;
        let mut pooled = vec![0f32; dcfg.pooled_dim];
        for row in hidden.chunks(h) {
            for (p, v) in pooled.iter_mut().zip(row) {
                *p += v / t_len as f32;
            }
        }
        let mut inputs = placeholder;
        inputs.context = hidden;
        inputs.pooled = pooled;

        // Phase 2: denoising, every step one pass over the streamed blocks.
        let baseline = nibble_core::io::machine::rss_bytes().unwrap_or(0);
        nibble_core::io::machine::reset_peak_rss();
        let resumed = match &o.resume {
            Some(d) => Some(
                Checkpoint::load(d)?
                    .with_context(|| format!("--resume {}: no checkpoint", d.display()))?,
            ),
            None => None,
        };
        let sigmas = schedule(o.steps, 1.0, true, inputs.image_tokens())?;
        let mut den = Denoiser::with_ring(dit, backend, inputs, sigmas, opts, ring)?;
        if let Some(c) = &resumed {
            den.restore(c)?;
            if !quiet {
                eprintln!("resuming the DiT phase after step {}", c.done);
            }
        }
        let plan = den.executor().plan().clone();
        let mut rows = Vec::new();
        let (mut rss, mut times) = (Vec::new(), Vec::new());
        let t2 = Instant::now();
        let total = den.steps();
        while let Some(s) = den.step()? {
            if let Some(d) = &o.checkpoint {
                den.checkpoint().save(d)?;
            }
            let ms = s.wall.as_secs_f64() * 1e3;
            if !quiet {
                let eta =
                    t2.elapsed().as_secs_f64() / (rows.len() + 1) as f64 * (total - s.step) as f64;
                eprintln!(
                    "{} step {:>3}/{total}  {:>8.1} ms  {:>10} streamed  stall {:>6.1} ms  RSS {}  ETA {:.0} s",
                    bar(s.step, total),
                    s.step,
                    ms,
                    fmt_bytes(s.stats.stream.bytes),
                    s.stats.stream.stall.as_secs_f64() * 1e3,
                    fmt_bytes(s.rss_bytes),
                    eta
                );
            }
            rss.push((s.step as f64, s.rss_bytes as f64 / (1 << 20) as f64));
            times.push((s.step as f64, ms));
            rows.push(crate::cmd::run::step_row(&s));
        }
        let dit_secs = t2.elapsed().as_secs_f64();
        let dit_peak = phase_peak();
        let process_peak = dit_peak.max(enc_peak);

        // Outputs.
        std::fs::create_dir_all(&o.out_dir)
            .with_context(|| format!("creating {}", o.out_dir.display()))?;
        let (n, c) = (den.inputs().image_tokens(), dcfg.in_channels);
        let latent = o.out_dir.join("latent.safetensors");
        crate::cmd::run::write_latent(&latent, den.latent(), n, c)?;
        let (gh, gw) = den.inputs().grid();
        let preview = o.out_dir.join("preview.png");
        crate::cmd::run::write_preview(&preview, den.latent(), gh, gw, c, 16)?;
        let (svg, png) = crate::output::chart::write(
            &o.out_dir.join("chart"),
            &format!(
                "nibble demo: {} NF4 DiT, device budget {}, ring {} x {}",
                fmt_bytes(dit.file_bytes()),
                fmt_bytes(budgets.device_bytes),
                budgets.ring_slots,
                fmt_bytes(budgets.slot_bytes)
            ),
            &[crate::output::chart::Series {
                name: format!("streamed ({label})"),
                rss_mib: rss.clone(),
                step_ms: times.clone(),
            }],
            Some(&crate::output::chart::Reference {
                name: "plan: host + device".into(),
                mib: (plan.peak_host_bytes + plan.peak_device_bytes) as f64 / (1 << 20) as f64,
            }),
        )?;
        let rss_b: Vec<u64> = rows
            .iter()
            .filter_map(|r| r["rss_bytes"].as_u64())
            .collect();
        let growth = match (rss_b.get(1).or(rss_b.first()), rss_b.last()) {
            (Some(a), Some(b)) => *b as i64 - *a as i64,
            _ => 0,
        };
        // The first step warms caches up: leave it out when there are others.
        let skip = usize::from(times.len() > 1);
        let mean_ms =
            times.iter().skip(skip).map(|t| t.1).sum::<f64>() / (times.len() - skip).max(1) as f64;
        let predicted = plan.peak_host_bytes + plan.peak_device_bytes;
        let summary = json!({
            "backend": label,
            "dit_bytes_on_disk": dit.file_bytes(),
            "steps": rows.len(),
            "ms_per_step_after_first": mean_ms,
            "dit_seconds": dit_secs,
            "bytes_streamed_per_step": plan.streamed_bytes_per_step,
            "rss_step2_bytes": rss_b.get(1),
            "rss_last_bytes": rss_b.last(),
            "rss_growth_from_step2_bytes": growth,
            "text_encoder_peak_rss_bytes": enc_peak,
            "dit_peak_rss_bytes": dit_peak,
            "process_peak_rss_bytes": process_peak,
            "plan_peak_host_bytes": plan.peak_host_bytes,
            "plan_peak_device_bytes": plan.peak_device_bytes,
            "dit_resident_groups": plan.counts().0,
            "dit_streamed_groups": plan.counts().1,
            "rss_between_phases_bytes": baseline,
            "text_encoder_ms": enc_ms,
            "chart_svg": svg, "chart_png": png, "latent": latent, "preview": preview,
        });
        std::fs::write(
            o.out_dir.join("steps.json"),
            serde_json::to_vec_pretty(&json!({"steps": rows, "summary": summary}))?,
        )?;
        if o.json {
            crate::output::write_stdout(&format!(
                "{}\n",
                json!({"steps": rows, "summary": summary})
            ))?;
        } else {
            eprintln!(
                "done: {} steps in {:.1} s ({:.0} ms/step after the first), {} streamed per step; RSS {} at step 2, {} at the end ({:+} bytes); peak RSS text encoder {}, DiT {} (plan: host {} + device {} = {})",
                rows.len(),
                dit_secs,
                mean_ms,
                fmt_bytes(plan.streamed_bytes_per_step),
                fmt_bytes(rss_b.get(1).copied().unwrap_or(0)),
                fmt_bytes(rss_b.last().copied().unwrap_or(0)),
                growth,
                fmt_bytes(enc_peak),
                fmt_bytes(dit_peak),
                fmt_bytes(plan.peak_host_bytes),
                fmt_bytes(plan.peak_device_bytes),
                fmt_bytes(predicted)
            );
            eprintln!(
                "chart: {} and {}; latent: {}; preview: {}",
                svg.display(),
                png.display(),
                latent.display(),
                preview.display()
            );
        }
        Ok(())
    }
}

/// Runs the demo.
pub fn run(o: &DemoArgs) -> Result<()> {
    let root = cache_root(o);
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    let size = o.dit_size;
    let dit_dir = root.join(format!("dit-{}-seed{}", o.dit_size, o.seed));
    ensure_model(
        &dit_dir,
        "synthetic NF4 Flux-style DiT",
        &SynthModel::new(Arch::Dit, size, o.seed),
        o.json,
    )?;
    let dit = ModelIndex::open(&dit_dir)?;
    let dcfg = DitConfig::of(&dit)?;
    let es = encoder_shape(dcfg.joint_dim);
    let enc_dir = root.join(format!(
        "text-encoder-{}x{}-{}layers-v{}-seed{}",
        es.hidden, es.intermediate, es.layers, es.vocab, o.seed
    ));
    ensure_model(
        &enc_dir,
        "synthetic Llama-style text encoder",
        &SynthModel::llama_with(es, o.seed + 1),
        o.json,
    )?;
    let encoder = ModelIndex::open(&enc_dir)?;
    crate::backends::select(o.backend)?.run(Demo {
        o,
        dit: &dit,
        encoder: &encoder,
    })
}
