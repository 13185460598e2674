//! `nibble run` on a diffusers `WanPipeline` folder: the prompt (and negative prompt) to a video
//! through core's [`WanPipeline`], or (`--vae-decode`) a given latent video through its VAE
//! alone; each phase's plan printed before any weight byte is read, progress per step with RSS;
//! the video as an MP4 (`--out`) and PNG frames (`--frames-dir`), the intermediate tensors under
//! diffusers' names (`--intermediates`), one JSON object (`--json`).

use std::collections::BTreeMap;

use anyhow::{bail, Context, Result};
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::pipeline::{Event, Pipeline, VaeTiling};
use nibble_core::models::wan::pipeline::{WanPipeline, WanRequest};
use nibble_core::models::wan::{WanCheckpoint, WanTiling};
use nibble_core::plan::MemoryPlan;
use serde_json::json;

use super::options::{RunArgs, TilingArg};
use super::progress::Progress;
use crate::output::frames::FrameSink;

/// Wan 2.1's frame rate (its `sample_fps`; diffusers' examples write `export_to_video(output,
/// fps=16)`).
const WAN_FPS: f64 = 16.0;

/// Opens the folder and runs it on the chosen backend.
pub fn run(o: &RunArgs) -> Result<()> {
    let mut pipe = WanPipeline::open(&o.model, o.file_mode.into())
        .with_context(|| format!("opening the Wan pipeline {}", o.model))?;
    pipe.transformer = o.lora.bind(
        &pipe.transformer,
        nibble_core::models::wan::lora::transformer_target(),
        o.file_mode.into(),
        o.json,
    )?;
    let d = &o.dit;
    if d.inputs.is_some()
        || d.preview.is_some()
        || d.dynamic_shift
        || d.latents.is_some()
        || d.embed_cache.is_some()
    {
        bail!(
            "--inputs, --preview, --dynamic-shift, --latents and --embed-cache are not taken by \
             a Wan folder"
        );
    }
    if d.out.is_none() && d.frames_dir.is_none() && d.intermediates.is_none() && !o.plan_only {
        bail!(
            "a Wan run needs somewhere to put the video: --out video.mp4 and/or --frames-dir DIR \
             (or --intermediates FILE)"
        );
    }
    if let Some(fps) = d.fps {
        crate::output::mp4::check_fps(fps)?;
    }
    let tiling = match d.vae_tiling {
        TilingArg::On => VaeTiling::On,
        TilingArg::Off => VaeTiling::Off,
        TilingArg::Auto => VaeTiling::Auto,
    };
    let tile = {
        let def = WanTiling::default();
        let t = WanTiling {
            tile: d.vae_tile_size.unwrap_or(def.tile),
            stride: d.vae_tile_stride.unwrap_or(def.stride),
        };
        t.check(pipe.vae_config.spatial_scale())?;
        t
    };
    if let Some(path) = &d.vae_decode {
        let given = o.text.prompt.is_some()
            || d.negative_prompt.is_some()
            || d.frames.is_some()
            || d.steps.is_some()
            || d.height.is_some()
            || d.width.is_some()
            || d.guidance.is_some();
        if given || d.checkpoint.is_some() || d.resume.is_some() {
            bail!(
                "--vae-decode decodes the latents as they are: --prompt, --negative-prompt, \
                 --frames, --steps, --height, --width, --guidance, --checkpoint and --resume do \
                 not apply"
            );
        }
        let (z, dims) = read_video_latents(path, pipe.vae_config.z_dim)?;
        let job = Decode {
            o,
            pipe,
            z,
            dims,
            tiling,
            tile,
        };
        return crate::backends::select(o.backend)?.run(job);
    }
    if !o.text.prompt_ids.is_empty() || o.text.chat {
        bail!("a Wan folder takes --prompt TEXT (tokenized by its umT5 tokenizer)");
    }
    let Some(prompt) = o.text.prompt.clone() else {
        bail!("a Wan folder needs --prompt TEXT (or --vae-decode LATENTS.safetensors)");
    };
    let resume = match &d.resume {
        Some(dir) => {
            let c = WanCheckpoint::load(dir)?.with_context(|| {
                format!(
                    "--resume {}: no Wan checkpoint there ({})",
                    dir.display(),
                    nibble_core::models::wan::checkpoint::WAN_CHECKPOINT_FILE
                )
            })?;
            if !o.json {
                eprintln!("resuming from {} after {} steps", dir.display(), c.done);
            }
            Some(c)
        }
        None => None,
    };
    let req = WanRequest {
        prompt,
        negative_prompt: d.negative_prompt.clone(),
        height: d.height.unwrap_or(480),
        width: d.width.unwrap_or(832),
        frames: d.frames.unwrap_or(81),
        steps: d.steps.unwrap_or(50),
        guidance: d.guidance.unwrap_or(5.0),
        seed: o.seed,
        max_sequence_length: d.max_sequence_length,
        vae_tiling: tiling,
        vae_tile: Some(tile),
        // The frames go to their files as they are decoded; the whole video is kept only for
        // `--intermediates` (`video_f32`).
        keep_video: d.intermediates.is_some(),
        checkpoint: d.checkpoint.clone(),
        resume,
    };
    crate::backends::select(o.backend)?.run(Run { o, pipe, req })
}

/// The latent video in `path`: the tensor `latents`, `[1, z, F, h, w]` or `[z, F, h, w]`.
fn read_video_latents(
    path: &std::path::Path,
    z_dim: usize,
) -> Result<(Vec<f32>, (usize, usize, usize))> {
    let f = ModelIndex::open(path).with_context(|| format!("--vae-decode {}", path.display()))?;
    let e = f
        .get("latents")
        .with_context(|| format!("{}: no tensor 'latents'", path.display()))?;
    let shape: Vec<usize> = e.shape.iter().map(|&d| d as usize).collect();
    let dims = match shape.as_slice() {
        [1, z, t, h, w] | [z, t, h, w] if *z == z_dim => (*t, *h, *w),
        _ => bail!(
            "{}: latents of shape {shape:?}; this VAE decodes [1, {z_dim}, frames, height, width]",
            path.display()
        ),
    };
    if dims.0 == 0 || dims.1 == 0 || dims.2 == 0 {
        bail!("{}: an empty latent video {shape:?}", path.display());
    }
    Ok((f.read_f32(e)?, dims))
}

struct Run<'a> {
    o: &'a RunArgs,
    pipe: WanPipeline,
    req: WanRequest,
}

impl crate::backends::WithBackend for Run<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, mut backend: B, label: &str) -> Result<()> {
        let Run { o, pipe, req } = self;
        if o.plan_only {
            let mut prepared = pipe.prepare(&req)?;
            return super::plan::print_pipeline(o, label, &pipe, &mut prepared, &mut backend);
        }
        let mut sink = sink_of(o);
        let g = generate(&pipe, &req, backend, label, o.json, &o.memory, &mut sink)?;
        let video = Video {
            frames: g.out.frames,
            height: g.out.height,
            width: g.out.width,
            tiling: g.prepared.tiling,
        };
        write(
            o,
            label,
            &video,
            sink,
            &g.out.tensors,
            &g.plans,
            &g.progress,
        )
    }
}

/// What one Wan run produced, with its plans and figures.
pub struct Generated {
    /// The video and the named intermediate tensors.
    pub out: nibble_core::models::wan::pipeline::WanOutput,
    /// Ids, the latent's size, the VAE tiling chosen.
    pub prepared: nibble_core::models::wan::pipeline::WanPrepared,
    /// Each phase's memory plan, in run order.
    pub plans: Vec<(&'static str, MemoryPlan)>,
    /// Per phase and per step figures, RSS.
    pub progress: Progress,
    /// The executor options the budgets gave.
    pub opts: ExecOptions,
}

/// Where `--out` and `--frames-dir` ask the frames to go.
fn sink_of(o: &RunArgs) -> FrameSink {
    FrameSink::new(
        o.dit.out.as_deref(),
        o.dit.fps.unwrap_or(WAN_FPS),
        o.dit.frames_dir.as_deref(),
    )
}

/// Runs `req` on `pipe`: budgets decided for `memory`, every phase planned (and printed unless
/// `quiet`) before any weight byte is read, progress per step, the frames into `sink` as they
/// are decoded; `nibble run` and `nibble demo --video` both run a Wan folder through here.
pub fn generate<B: Backend + 'static>(
    pipe: &WanPipeline,
    req: &WanRequest,
    mut backend: B,
    label: &str,
    quiet: bool,
    memory: &crate::args::MemoryArgs,
    sink: &mut FrameSink,
) -> Result<Generated> {
    let mut prepared = pipe.prepare(req)?;
    let opts = super::flux::pipeline_options(memory, pipe, &prepared, &mut backend, quiet)?;
    let plans = pipe.plans(&mut prepared, &mut backend, opts)?;
    let (f, h, w) = prepared.dims;
    if !quiet {
        eprintln!("backend {label}");
        eprintln!(
            "{} x {} x {} frames, {} steps, guidance {}, latent {f} x {h} x {w}, {} tokens{}",
            req.width,
            req.height,
            req.frames,
            req.steps,
            req.guidance,
            prepared.ids.0.len(),
            match prepared.tiling {
                Some(t) => format!(
                    "; VAE in tiles of {} x {} pixels every {} x {}",
                    t.tile.1, t.tile.0, t.stride.1, t.stride.0
                ),
                None => String::new(),
            }
        );
        print_plans(&plans);
    }
    let mut progress = Progress::start(quiet);
    let out = pipe.run(&prepared, backend, opts, |e| {
        to_sink(sink, &e);
        progress.on(e)
    })?;
    Ok(Generated {
        out,
        prepared,
        plans,
        progress,
        opts,
    })
}

/// `--vae-decode`: a given latent video through the VAE alone.
struct Decode<'a> {
    o: &'a RunArgs,
    pipe: WanPipeline,
    z: Vec<f32>,
    dims: (usize, usize, usize),
    tiling: VaeTiling,
    tile: WanTiling,
}

impl crate::backends::WithBackend for Decode<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, mut backend: B, label: &str) -> Result<()> {
        let Decode {
            o,
            pipe,
            z,
            dims: (f, h, w),
            tiling,
            tile,
        } = self;
        let quiet = o.json;
        // Budgets from the tile's graph wherever tiling may be chosen, then the tiling settled
        // under them and the decoder planned as it will run.
        let s = pipe.vae_config.spatial_scale();
        let may_tile = tiling != VaeTiling::Off && tile.tiles((h, w), s);
        let sizing = pipe.vae_graph((h, w), may_tile.then_some(tile))?;
        let d = super::options::decide(&o.memory, &mut backend, &[(&sizing, &pipe.vae)])?;
        let opts = ExecOptions::decided(&d, 2);
        let settled = pipe.vae_tiling((h, w), tiling, tile, &mut backend, opts)?;
        let graph = pipe.vae_graph((h, w), settled)?;
        if o.plan_only {
            let machine = nibble_core::plan::budget::Machine::measure();
            let planned = nibble_core::plan::budget::phase_budgets(
                d.budgets,
                d.stream_all,
                &machine,
                &mut backend,
                &[(&graph, &pipe.vae)],
            )?;
            let named: Vec<_> = ["VAE"].into_iter().zip(planned).collect();
            return super::plan::print(o, label, &d.note, &named);
        }
        let plans = nibble_core::models::pipeline::plan_phases(
            &[("VAE", graph, &pipe.vae)],
            &mut backend,
            opts,
        )?;
        if !quiet {
            eprintln!("backend {label}");
            eprintln!("{}", d.note.note);
            eprintln!(
                "decoding {f} latent frames of {h} x {w} into {} frames of {} x {}{}",
                pipe.vae_config.frames(f),
                w * s,
                h * s,
                match settled {
                    Some(t) => format!(
                        " in tiles of {} x {} pixels every {} x {}",
                        t.tile.1, t.tile.0, t.stride.1, t.stride.0
                    ),
                    None => String::new(),
                }
            );
            print_plans(&plans);
        }
        let mut progress = Progress::start(quiet);
        progress.on(Event::PhaseStart { phase: "VAE" });
        let t0 = std::time::Instant::now();
        let mut sink = sink_of(o);
        let (video, _, bytes) = nibble_core::io::folder::block_on(pipe.decode_latents(
            &z,
            (f, h, w),
            settled,
            backend,
            opts,
            &nibble_core::models::Drive::Blocking,
            o.dit.intermediates.is_some(),
            &mut |e| {
                to_sink(&mut sink, &e);
                progress.on(e)
            },
        ))?;
        progress.on(Event::PhaseDone {
            phase: "VAE",
            ms: t0.elapsed().as_secs_f64() * 1e3,
            bytes_streamed: bytes,
        });
        let (oc, frames) = (pipe.vae_config.out_channels, pipe.vae_config.frames(f));
        let mut tensors = BTreeMap::new();
        if let Some(video) = video {
            tensors.insert(
                "video_f32".to_string(),
                (vec![1, oc, frames, h * s, w * s], video),
            );
        }
        let out = Video {
            frames,
            height: h * s,
            width: w * s,
            tiling: settled,
        };
        write(o, label, &out, sink, &tensors, &plans, &progress)
    }
}

/// Hands decoded frames to `sink`.
fn to_sink(sink: &mut FrameSink, e: &Event<'_>) {
    if let Event::Frames {
        first,
        width,
        height,
        rgb,
        ..
    } = e
    {
        sink.take(*first, (*height, *width), rgb);
    }
}

fn print_plans(plans: &[(&'static str, MemoryPlan)]) {
    for (i, (phase, plan)) in plans.iter().enumerate() {
        eprintln!("phase {} of {}, {phase}:", i + 1, plans.len());
        eprint!("{}", plan.explain());
    }
}

/// A decoded video's size.
struct Video {
    frames: usize,
    height: usize,
    width: usize,
    tiling: Option<WanTiling>,
}

/// Closes the frames' files (written as they were decoded) and writes the rest the flags ask
/// for: the intermediates, the JSON report.
fn write(
    o: &RunArgs,
    label: &str,
    v: &Video,
    sink: FrameSink,
    tensors: &BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    plans: &[(&'static str, MemoryPlan)],
    progress: &Progress,
) -> Result<()> {
    let quiet = o.json;
    let done = sink.finish()?;
    if let (Some(dir), false) = (&o.dit.frames_dir, quiet) {
        eprintln!(
            "wrote {} frames ({} x {}) into {}",
            done.pngs.len(),
            v.width,
            v.height,
            dir.display()
        );
    }
    if let (Some((path, mp4)), false) = (&done.mp4, quiet) {
        eprintln!(
            "wrote {} ({} frames of {} x {} at {} fps, H.264, {:.1} KiB)",
            path.display(),
            mp4.frames,
            v.width,
            v.height,
            o.dit.fps.unwrap_or(WAN_FPS),
            mp4.bytes as f64 / 1024.0
        );
    }
    if let Some(path) = &o.dit.intermediates {
        crate::output::write_f32_tensors(path, tensors)?;
    }
    if quiet {
        crate::output::write_stdout(
            &(json!({
                "backend": label,
                "frames": v.frames, "width": v.width, "height": v.height,
                "plans": super::flux::plans_json(plans),
                "phases": progress.phases, "steps": progress.steps,
                "baseline_rss_bytes": progress.baseline, "peak_rss_bytes": progress.peak,
                "vae_tiling": v.tiling.map(|t| json!({"tile": [t.tile.0, t.tile.1],
                    "stride": [t.stride.0, t.stride.1]})),
                "frame_files": done.pngs,
                "video": done.mp4.as_ref().map(|(p, _)| p.display().to_string()),
                "intermediates": o.dit.intermediates.as_ref().map(|p| p.display().to_string()),
            })
            .to_string()
                + "\n"),
        )?;
    }
    Ok(())
}
