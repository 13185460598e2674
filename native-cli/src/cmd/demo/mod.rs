//! `nibble demo`: the situation nibble exists for, on a built-in default. A diffusers Flux
//! pipeline folder (synthetic: real file formats and tokenizers, random weights, an NF4
//! transformer of ~1.5 GiB and an NF4 T5 of a few hundred MiB, written once into a cache
//! folder) turns a prompt into a PNG in a device budget far below the transformer's size: CLIP
//! and T5 encode the prompt, the transformer denoises with its blocks streamed through a fixed
//! ring every step, the VAE decodes. Every phase is planned before the first weight byte is
//! read, each phase's device memory is released before the next allocates; per step: wall
//! time, bytes streamed, stall, RSS; at the end a summary, the image and a chart of RSS and
//! step time against step.
//!
//! It runs through the same code as `nibble run --model PIPELINE` ([`crate::cmd::run::flux`]).
//! Random weights give a noise picture; a real Flux folder gives a real one.

mod video;

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result};
use clap::Args;
use nibble_core::backend::Backend;
use nibble_core::models::flux::noise::NoiseMath;
use nibble_core::models::flux::pipeline::{FluxPipeline, FluxRequest, Noise, VaeTiling};
use nibble_core::plan::fmt_bytes;
use nibble_core::tooling::synth_flux::{write_pipeline, FluxSynthShape};
use serde_json::json;

use crate::args::{
    budget, count_or_auto, size, size_or_auto, BackendArg, Budget, MemoryArgs, OrAuto,
};
use crate::cmd::run::flux::{generate, pipeline_options, plans_json};
use crate::output::write_png;

/// Options of `nibble demo`.
#[derive(Debug, Clone, Args)]
pub struct DemoArgs {
    /// Text to video instead: a synthetic Wan 2.1 folder (the 1.3B transformer's shape, NF4;
    /// umT5 and the video VAE) through the whole pipeline to an MP4.
    #[arg(long)]
    pub video: bool,
    /// With --video: frames (4k + 1).
    #[arg(long, default_value_t = 9)]
    pub frames: usize,
    /// Denoising steps [default: 50; 8 with --video].
    #[arg(long, value_parser = crate::args::steps)]
    pub steps: Option<usize>,
    /// Image height in pixels (a multiple of 16).
    #[arg(long, default_value_t = 128)]
    pub height: usize,
    /// Image width in pixels (a multiple of 16).
    #[arg(long, default_value_t = 128)]
    pub width: usize,
    /// T5 tokens the prompt is padded or cut to.
    #[arg(long, default_value_t = 64)]
    pub max_sequence_length: usize,
    /// The prompt (tokenized by the folder's CLIP and T5 tokenizers).
    #[arg(long, default_value = "a lighthouse on a cliff at dusk, oil on canvas")]
    pub prompt: String,
    /// Guidance [default: 3.5 embedded into the transformer, FLUX.1-dev's; with --video 5.0,
    /// classifier-free, both sequences in one pass over the weights].
    #[arg(long)]
    pub guidance: Option<f32>,
    /// Size of the synthetic transformer on disk [default: 1800MiB; with --video the real
    /// Wan 2.1 1.3B shape, about 700 MiB in NF4].
    #[arg(long, value_parser = size, value_name = "SIZE")]
    pub dit_size: Option<u64>,
    /// Layers of the synthetic T5 (umT5 with --video) encoder (4096 wide; about 170 MiB each in
    /// NF4 + dense `wo`).
    #[arg(long, default_value_t = 2)]
    pub t5_layers: u64,
    /// Seed of the models and of the noise (torch's CPU generator, as diffusers draws it).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Device memory for each phase: a size, or `auto` (as `nibble run --device-budget`).
    #[arg(long, value_parser = budget, default_value = "512MiB", value_name = "SIZE|auto")]
    pub device_budget: Budget,
    /// Host memory the run may use: a size, or `auto` (as `nibble run --host-budget`).
    #[arg(long, value_parser = budget, default_value = "auto", value_name = "SIZE|auto")]
    pub host_budget: Budget,
    /// Ring slots, or `auto` (as `nibble run --slots`).
    #[arg(long, value_parser = count_or_auto, default_value = "4", value_name = "N|auto")]
    pub slots: OrAuto,
    /// Bytes per ring slot, or `auto` (as `nibble run --slot-size`).
    #[arg(long, value_parser = size_or_auto, default_value = "32MiB", value_name = "SIZE|auto")]
    pub slot_size: OrAuto,
    /// Backend that runs the ops.
    #[arg(long, value_enum, default_value_t)]
    pub backend: BackendArg,
    /// Where the image, the chart and the per-step figures go.
    #[arg(long, default_value = "nibble-demo")]
    pub out_dir: PathBuf,
    /// Where the synthetic pipeline is kept (default $NIBBLE_CACHE or ~/.cache/nibble).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Print one JSON object.
    #[arg(long)]
    pub json: bool,
}

impl DemoArgs {
    /// The memory flags as `nibble run` takes them.
    pub(super) fn memory(&self) -> MemoryArgs {
        MemoryArgs {
            device_budget: self.device_budget,
            host_budget: self.host_budget,
            slots: self.slots,
            slot_size: self.slot_size,
            stream_all: false,
        }
    }
}

/// What both demos chart and sum up from the transformer's steps (rows as `run --json` has
/// them): RSS per step, its growth from step 2, the mean step time after the first, the chart.
pub(super) struct StepFigures {
    pub(super) rss: Vec<u64>,
    pub(super) growth: i64,
    pub(super) mean_ms: f64,
    pub(super) svg: PathBuf,
    pub(super) png: PathBuf,
}

impl StepFigures {
    /// The figures of `steps`, and their chart (`out_dir/chart.{svg,png}`, titled `title`, the
    /// series `name`, with the plan's `plan_bytes` as the reference line).
    pub(super) fn chart(
        steps: &[serde_json::Value],
        out_dir: &Path,
        title: &str,
        name: String,
        plan_bytes: u64,
    ) -> Result<Self> {
        let col = |key: &str, scale: f64| -> Vec<(f64, f64)> {
            steps
                .iter()
                .map(|r| {
                    (
                        r["step"].as_f64().unwrap_or(0.0),
                        r[key].as_f64().unwrap_or(0.0) / scale,
                    )
                })
                .collect()
        };
        let (times, rss_mib) = (col("wall_ms", 1.0), col("rss_bytes", (1 << 20) as f64));
        let (svg, png) = crate::output::chart::write(
            &out_dir.join("chart"),
            title,
            &[crate::output::chart::Series {
                name,
                rss_mib,
                step_ms: times.clone(),
            }],
            Some(&crate::output::chart::Reference {
                name: "plan: baseline + host + device".into(),
                mib: plan_bytes as f64 / (1 << 20) as f64,
            }),
        )?;
        let rss: Vec<u64> = steps
            .iter()
            .filter_map(|r| r["rss_bytes"].as_u64())
            .collect();
        let growth = match (rss.get(1).or(rss.first()), rss.last()) {
            (Some(a), Some(b)) => *b as i64 - *a as i64,
            _ => 0,
        };
        // The first step warms caches up: leave it out when there are others.
        let skip = usize::from(times.len() > 1);
        let mean_ms =
            times.iter().skip(skip).map(|t| t.1).sum::<f64>() / (times.len() - skip).max(1) as f64;
        Ok(StepFigures {
            rss,
            growth,
            mean_ms,
            svg,
            png,
        })
    }
}

/// Writes `steps.json` (the steps and the summary) into the output folder and, with `--json`,
/// prints the same object; whether it printed.
pub(super) fn write_report(
    o: &DemoArgs,
    steps: &[serde_json::Value],
    summary: &serde_json::Value,
) -> Result<bool> {
    let report = json!({"steps": steps, "summary": summary});
    std::fs::write(
        o.out_dir.join("steps.json"),
        serde_json::to_vec_pretty(&report)?,
    )?;
    if o.json {
        crate::output::write_stdout(&format!("{report}\n"))?;
    }
    Ok(o.json)
}

pub(super) fn cache_root(o: &DemoArgs) -> PathBuf {
    o.cache_dir
        .clone()
        .or_else(|| std::env::var_os("NIBBLE_CACHE").map(PathBuf::from))
        .or_else(|| std::env::var_os("HOME").map(|h| Path::new(&h).join(".cache/nibble")))
        .unwrap_or_else(|| PathBuf::from(".nibble-cache"))
        .join("demo")
}

/// Writes a synthetic pipeline (`what`) into `dir` once with `write`: into `dir.partial`,
/// renamed when complete, reused afterwards.
pub(super) fn ensure_folder(
    dir: &Path,
    what: &str,
    quiet: bool,
    write: impl FnOnce(&Path, &mut dyn FnMut(&str, u64, u64)) -> nibble_core::error::Result<()>,
) -> Result<()> {
    if dir.join("model_index.json").is_file() {
        return Ok(());
    }
    let partial = dir.with_extension("partial");
    let _ = std::fs::remove_dir_all(&partial);
    if !quiet {
        eprintln!(
            "writing a synthetic {what} (random weights) into {} (once; reused later)",
            dir.display()
        );
    }
    let t = Instant::now();
    let mut last = (String::new(), 0u64);
    write(&partial, &mut |component, done, total| {
        let new = last.0 != component;
        if !quiet && (new || done - last.1 >= 256 << 20 || done == total) {
            eprintln!(
                "  {component:<15} {:>5.1}%  {} / {}",
                done as f64 * 100.0 / total.max(1) as f64,
                fmt_bytes(done),
                fmt_bytes(total)
            );
            last = (component.to_string(), done);
        }
    })?;
    std::fs::rename(&partial, dir).with_context(|| format!("renaming into {}", dir.display()))?;
    if !quiet {
        eprintln!("  done in {:.1} s", t.elapsed().as_secs_f64());
    }
    Ok(())
}

struct Demo<'a> {
    o: &'a DemoArgs,
    pipe: FluxPipeline,
    req: FluxRequest,
}

impl crate::backends::WithBackend for Demo<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, backend: B, label: &str) -> Result<()> {
        let Demo { o, pipe, req } = self;
        let quiet = o.json;
        let memory = o.memory();
        let mut opts = None;
        let t0 = Instant::now();
        let g = generate(
            &pipe,
            &req,
            backend,
            label,
            quiet,
            None,
            |pipe, prepared, backend| {
                let o = pipeline_options(&memory, pipe, prepared, backend, quiet)?;
                opts = Some(o);
                Ok(o)
            },
        )?;
        let opts = opts.context("the pipeline decided its budgets")?;
        let total_secs = t0.elapsed().as_secs_f64();

        std::fs::create_dir_all(&o.out_dir)
            .with_context(|| format!("creating {}", o.out_dir.display()))?;
        let image = o.out_dir.join("image.png");
        write_png(&image, &g.out.rgb, g.out.width, g.out.height)?;
        let (dit_phase, plan) = g
            .plans
            .iter()
            .find(|(p, _)| *p == "transformer")
            .context("the pipeline has a transformer phase")?;
        let f = StepFigures::chart(
            &g.steps,
            &o.out_dir,
            &format!(
                "nibble demo: {} NF4 Flux transformer, device budget {}, ring {} x {}",
                fmt_bytes(pipe.transformer.file_bytes()),
                fmt_bytes(opts.budgets.device_bytes),
                opts.budgets.ring_slots,
                fmt_bytes(opts.budgets.slot_bytes)
            ),
            format!("{dit_phase} ({label})"),
            g.baseline + plan.peak_host_bytes + plan.peak_device_bytes,
        )?;
        let (rss_b, growth, mean_ms, svg, png) = (&f.rss, f.growth, f.mean_ms, &f.svg, &f.png);
        let phase = |name: &str| g.phases.iter().find(|p| p["phase"] == name);
        let phase_peak = |name: &str| phase(name).and_then(|p| p["peak_rss_bytes"].as_u64());
        let largest_plan = g
            .plans
            .iter()
            .map(|(_, p)| p.peak_host_bytes + p.peak_device_bytes)
            .max()
            .unwrap_or(0);
        let summary = json!({
            "backend": label,
            "pipeline": pipe.root,
            "prompt": req.prompt,
            "width": g.out.width, "height": g.out.height,
            "dit_bytes_on_disk": pipe.transformer.file_bytes(),
            "t5_bytes_on_disk": pipe.text_encoder_2.file_bytes(),
            "steps": g.steps.len(),
            "ms_per_step_after_first": mean_ms,
            "seconds_total": total_secs,
            "vae_ms": phase("VAE").and_then(|p| p["ms"].as_f64()),
            "bytes_streamed_per_step": plan.streamed_bytes_per_step,
            "rss_step2_bytes": rss_b.get(1),
            "rss_last_bytes": rss_b.last(),
            "rss_growth_from_step2_bytes": growth,
            "baseline_rss_bytes": g.baseline,
            "peak_rss_bytes": g.peak,
            "largest_phase_plan_bytes": largest_plan,
            "dit_peak_rss_bytes": phase_peak("transformer"),
            "plan_peak_host_bytes": plan.peak_host_bytes,
            "plan_peak_device_bytes": plan.peak_device_bytes,
            "dit_resident_groups": plan.counts().0,
            "dit_streamed_groups": plan.counts().1,
            "phases": g.phases,
            "plans": plans_json(&g.plans),
            "image": image, "chart_svg": svg, "chart_png": png,
            "note": "random weights give a noise picture; a real Flux folder gives a real one",
        });
        if !write_report(o, &g.steps, &summary)? {
            eprintln!(
                "done: {} x {} image in {:.1} s; {} steps, {:.0} ms/step after the first, {} \
                 streamed per step; RSS {} at step 2, {} at the end ({:+} bytes); peak RSS {} \
                 (baseline {} + largest phase plan {} = {})",
                g.out.width,
                g.out.height,
                total_secs,
                g.steps.len(),
                mean_ms,
                fmt_bytes(plan.streamed_bytes_per_step),
                fmt_bytes(rss_b.get(1).copied().unwrap_or(0)),
                fmt_bytes(rss_b.last().copied().unwrap_or(0)),
                growth,
                fmt_bytes(g.peak),
                fmt_bytes(g.baseline),
                fmt_bytes(largest_plan),
                fmt_bytes(g.baseline + largest_plan)
            );
            eprintln!(
                "image: {} (the weights are random, so the picture is noise; `nibble run \
                 --model FLUX_FOLDER --prompt ...` on a real Flux folder gives a real one)",
                image.display()
            );
            eprintln!("chart: {} and {}", svg.display(), png.display());
        }
        Ok(())
    }
}

/// Runs the demo.
pub fn run(o: &DemoArgs) -> Result<()> {
    let root = cache_root(o);
    std::fs::create_dir_all(&root).with_context(|| format!("creating {}", root.display()))?;
    if o.video {
        return video::run(o, &root);
    }
    let shape = FluxSynthShape {
        dit_bytes: o.dit_size.unwrap_or(1800 << 20),
        t5_layers: o.t5_layers.max(1),
        ..Default::default()
    };
    let dir = root.join(format!(
        "flux-dit{}-t5x{}-seed{}-v1",
        shape.dit_bytes, shape.t5_layers, o.seed
    ));
    ensure_folder(&dir, "Flux pipeline", o.json, |d, p| {
        write_pipeline(d, shape, o.seed, p)
    })?;
    let pipe = FluxPipeline::open(&dir.to_string_lossy(), Default::default())
        .with_context(|| format!("opening the demo pipeline {}", dir.display()))?;
    let req = FluxRequest {
        prompt: o.prompt.clone(),
        height: o.height,
        width: o.width,
        steps: o.steps.unwrap_or(50),
        guidance: o.guidance.unwrap_or(3.5),
        max_sequence_length: o.max_sequence_length,
        noise: Noise::Seed(o.seed, NoiseMath::AvxMathfun),
        vae_tiling: VaeTiling::Auto,
        vae_tile: None,
    };
    crate::backends::select(o.backend)?.run(Demo { o, pipe, req })
}
