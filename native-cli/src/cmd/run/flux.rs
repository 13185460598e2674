//! `nibble run` on a diffusers Flux pipeline folder (the model kind from `model_index.json`):
//! the prompt to a PNG through CLIP, T5, the transformer and the VAE, each phase planned before
//! anything is read, progress per phase and per step, `--json` with per-phase and per-step time,
//! bytes streamed and RSS, `--intermediates` with the tensors diffusers names.

use anyhow::{bail, Context, Result};
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::format::dtype::{f32_to_bytes, Dtype};
use nibble_core::io::model::ModelIndex;
use nibble_core::models::flux::noise::NoiseMath;
use nibble_core::models::flux::pipeline::{Embeds, FluxPipeline, FluxRequest, Noise, Prepared};
use nibble_core::models::pipeline::Pipeline;
use nibble_core::plan::MemoryPlan;
use serde_json::json;

use super::options::{NoiseArg, RunArgs, TilingArg};
use nibble_core::models::flux::pipeline::VaeTiling;

/// Opens the pipeline and runs it on the chosen backend.
pub fn run(o: &RunArgs) -> Result<()> {
    let mut pipe = FluxPipeline::open(&o.model, o.file_mode.into())
        .with_context(|| format!("opening the Flux pipeline {}", o.model))?;
    {
        use nibble_core::models::flux::lora::{clip_target, t5_target, transformer_target};
        let mut bound = o.lora.bind_pipeline(
            &[
                (&pipe.transformer, transformer_target()),
                (&pipe.text_encoder, clip_target()),
                (&pipe.text_encoder_2, t5_target()),
            ],
            o.file_mode.into(),
            o.json,
        )?;
        pipe.text_encoder_2 = bound.pop().expect("three models");
        pipe.text_encoder = bound.pop().expect("three models");
        pipe.transformer = bound.pop().expect("three models");
    }
    if !o.text.prompt_ids.is_empty() || o.text.chat {
        bail!("a Flux pipeline takes --prompt TEXT (tokenized by its CLIP and T5 tokenizers)");
    }
    let Some(prompt) = o.text.prompt.clone() else {
        bail!("a Flux pipeline needs --prompt TEXT");
    };
    if o.dit.inputs.is_some()
        || o.dit.checkpoint.is_some()
        || o.dit.resume.is_some()
        || o.dit.preview.is_some()
        || o.dit.dynamic_shift
    {
        bail!(
            "--inputs, --checkpoint, --resume, --preview and --dynamic-shift are for a lone DiT; \
             a pipeline folder's schedule comes from its scheduler_config.json"
        );
    }
    let d = &o.dit;
    super::options::refuse_wan_flags(d, &o.model)?;
    let noise = match &d.latents {
        Some(path) => Noise::Latents(read_latents(path)?),
        None => Noise::Seed(
            o.seed,
            match d.torch_noise {
                NoiseArg::Avx2 => NoiseMath::AvxMathfun,
                NoiseArg::Scalar => NoiseMath::Libm,
            },
        ),
    };
    let req = FluxRequest {
        prompt,
        height: d.height.unwrap_or(1024),
        width: d.width.unwrap_or(1024),
        steps: d.steps.unwrap_or(28),
        guidance: d.guidance.unwrap_or(3.5),
        max_sequence_length: d.max_sequence_length,
        noise,
        vae_tiling: match d.vae_tiling {
            TilingArg::On => VaeTiling::On,
            TilingArg::Off => VaeTiling::Off,
            TilingArg::Auto => VaeTiling::Auto,
        },
        vae_tile: match d.vae_tile_size {
            Some((h, w)) if h != w => bail!(
                "--vae-tile-size {h},{w}: a Flux VAE tile is square, N latent positions a side"
            ),
            t => t.map(|t| t.0),
        },
    };
    crate::backends::select(o.backend)?.run(Run { o, pipe, req })
}

/// Packed latents from a safetensors file (`latents` or `initial_latents`).
fn read_latents(path: &std::path::Path) -> Result<Vec<f32>> {
    let f = ModelIndex::open(path)?;
    let e = ["latents", "initial_latents"]
        .iter()
        .find_map(|n| f.get(n))
        .with_context(|| {
            format!(
                "{}: no tensor 'latents' or 'initial_latents'",
                path.display()
            )
        })?;
    Ok(f.read_f32(e)?)
}

struct Run<'a> {
    o: &'a RunArgs,
    pipe: FluxPipeline,
    req: FluxRequest,
}

/// What one pipeline run produced, with its plans and figures.
pub struct Generated {
    /// The image and the named intermediate tensors.
    pub out: nibble_core::models::flux::pipeline::FluxOutput,
    /// Token ids, grid, schedule and the VAE tiling chosen.
    pub prepared: Prepared,
    /// Each phase's memory plan, in run order.
    pub plans: Vec<(&'static str, MemoryPlan)>,
    /// Per phase: name, ms, bytes streamed, peak RSS (or `cached`).
    pub phases: Vec<serde_json::Value>,
    /// Per denoising step: [`super::dit::step_row`].
    pub steps: Vec<serde_json::Value>,
    /// RSS before the first phase allocated.
    pub baseline: u64,
    /// The run's peak RSS (the largest phase's).
    pub peak: u64,
    /// `off`, `hit` or `miss`.
    pub cache: &'static str,
}

/// Prepares, plans (printing the plans unless `quiet`) and runs the pipeline on `backend`,
/// printing progress per phase and step; `budget` gives the executor options once the request
/// is prepared. The encoders' outputs come from and go to `embed_cache` when given. `nibble
/// run` on a pipeline folder and `nibble demo` both run through here.
pub fn generate<B: Backend + 'static>(
    pipe: &FluxPipeline,
    req: &FluxRequest,
    mut backend: B,
    label: &str,
    quiet: bool,
    embed_cache: Option<&std::path::Path>,
    budget: impl FnOnce(&FluxPipeline, &Prepared, &mut B) -> Result<ExecOptions>,
) -> Result<Generated> {
    let mut prepared = pipe.prepare(req)?;
    if let Some(dir) = embed_cache {
        cache_folder(dir)?;
    }
    let key = pipe.embed_key(&prepared);
    let cache = embed_cache.map(|dir| dir.join(format!("{key}.safetensors")));
    let dims = {
        let c = nibble_core::models::dit::DitConfig::of(&pipe.transformer)?;
        (c.pooled_dim, c.joint_dim)
    };
    let hit = match &cache {
        Some(path) if path.is_file() => {
            match read_embeds(path, &key, prepared.t5_ids.len(), dims) {
                Ok(e) => {
                    prepared.embeds = Some(e);
                    true
                }
                Err(e) => {
                    // A damaged entry is recomputed (and rewritten), not fatal.
                    eprintln!("warning: {e:#}; encoding the prompt again");
                    false
                }
            }
        }
        _ => false,
    };
    let opts = budget(pipe, &prepared, &mut backend)?;
    let plans = pipe.plans(&mut prepared, &mut backend, opts)?;
    if !quiet {
        eprintln!("backend {label}");
        eprintln!(
            "{} x {} image, {} steps, mu {:.4}, {} T5 tokens",
            req.width,
            req.height,
            req.steps,
            prepared.mu,
            prepared.t5_ids.len()
        );
        for (i, (phase, plan)) in plans.iter().enumerate() {
            eprintln!("phase {} of 4, {phase}:", i + 1);
            eprint!("{}", plan.explain());
        }
        if let Some(t) = prepared.tiling {
            let shapes = t.shapes(prepared.grid.0, prepared.grid.1);
            eprintln!(
                "VAE decodes in tiles of {} latent positions (overlap {}, stride {}; {} tile \
                 shapes, the largest planned above)",
                t.latent_tile,
                t.overlap,
                t.stride(),
                shapes.len()
            );
        }
    }
    let mut progress = super::progress::Progress::start(quiet);
    let out = pipe.run(&prepared, backend, opts, |e| progress.on(e))?;
    let super::progress::Progress {
        phases,
        steps,
        baseline,
        peak,
        ..
    } = progress;
    if let (Some(path), false) = (&cache, hit) {
        // The image is made: a cache that cannot be written costs the next run time, not this one
        // its result.
        if let Err(e) = write_embeds(path, &key, &out.tensors) {
            eprintln!("warning: {e:#}; the prompt's embeddings were not cached");
        }
    }
    Ok(Generated {
        out,
        prepared,
        plans,
        phases,
        steps,
        baseline,
        peak,
        cache: match (&cache, hit) {
            (None, _) => "off",
            (Some(_), true) => "hit",
            (Some(_), false) => "miss",
        },
    })
}

/// The executor options of a pipeline's run (core's budget decision over its phases, sized
/// before what the budgets decide), the note printed unless `quiet`.
pub fn pipeline_options<P: Pipeline, B: Backend>(
    memory: &crate::args::MemoryArgs,
    pipe: &P,
    prepared: &P::Prepared,
    backend: &mut B,
    quiet: bool,
) -> Result<ExecOptions> {
    let phases = pipe.budget_graphs(prepared)?;
    let graphs: Vec<_> = phases.iter().map(|(_, g, m)| (g, *m)).collect();
    let (opts, note) = super::options::exec_options(memory, backend, &graphs)?;
    if !quiet {
        eprintln!("{}", note.note);
    }
    Ok(opts)
}

/// Each phase's plan, as `--json` reports it (the one plan shape, with its phase).
pub fn plans_json(plans: &[(&'static str, MemoryPlan)]) -> serde_json::Value {
    plans.iter().map(|(phase, p)| p.phase_json(phase)).collect()
}

impl crate::backends::WithBackend for Run<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, mut backend: B, label: &str) -> Result<()> {
        let Run { o, pipe, req } = self;
        let quiet = o.json;
        if o.plan_only {
            let mut prepared = pipe.prepare(&req)?;
            return super::plan::print_pipeline(o, label, &pipe, &mut prepared, &mut backend);
        }
        let g = generate(
            &pipe,
            &req,
            backend,
            label,
            quiet,
            o.dit.embed_cache.as_deref(),
            |pipe, prepared, backend| pipeline_options(&o.memory, pipe, prepared, backend, quiet),
        )?;
        let out = &g.out;
        if let Some(path) = &o.dit.out {
            crate::output::write_png(path, &out.rgb, out.width, out.height)?;
            if !quiet {
                eprintln!("wrote {} ({} x {})", path.display(), out.width, out.height);
            }
        }
        if let Some(path) = &o.dit.intermediates {
            crate::output::write_f32_tensors(path, &out.tensors)?;
        }
        if quiet {
            crate::output::write_stdout(
                &(json!({
                    "model": o.model, "backend": label, "width": out.width, "height": out.height,
                    "steps": g.steps, "phases": g.phases, "plans": plans_json(&g.plans),
                    "mu": g.prepared.mu, "sigmas": g.prepared.sigmas,
                    "baseline_rss_bytes": g.baseline,
                    "peak_rss_bytes": g.peak,
                    "embed_cache": g.cache,
                    "vae_tile": g.prepared.tiling.map(|t| t.latent_tile),
                })
                .to_string()
                    + "\n"),
            )?;
        }
        Ok(())
    }
}

/// What an embedding cache entry records of itself: the key it was written under and the
/// SHA-256 of its tensors' bytes, so that an entry is trusted by content, not by its name.
const KEY_FIELD: &str = "nibble_embed_key";
const SUM_FIELD: &str = "sha256";

/// SHA-256 (hex) of the pooled and the per-token embeddings' bytes, in that order.
fn embeds_sum(pooled: &[u8], context: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    let mut h = Sha256::new();
    h.update(pooled);
    h.update(context);
    h.finalize().iter().map(|b| format!("{b:02x}")).collect()
}

/// The encoders' outputs from a cache entry (`pooled_prompt_embeds`, `prompt_embeds`), checked
/// by content: written under `key` (not copied from another prompt or model), the sizes this
/// pipeline's transformer takes (`pooled` values, `t5_tokens` x `joint` values), and bytes that
/// hash to the sum recorded when it was written. Any mismatch is an error (the caller encodes
/// the prompt again and rewrites the entry).
fn read_embeds(
    path: &std::path::Path,
    key: &str,
    t5_tokens: usize,
    (pooled_dim, joint_dim): (usize, usize),
) -> Result<Embeds> {
    let what = || format!("embedding cache {}", path.display());
    let f = ModelIndex::open(path).with_context(what)?;
    let meta = &f.shards.first().context("no file")?.header.metadata;
    if meta.get(KEY_FIELD).map(String::as_str) != Some(key) {
        bail!("{}: written for another prompt or model", what());
    }
    // Each tensor's size is checked from the header before a byte of it is read: an entry of
    // the wrong size (another model's, or a huge one) is a miss, not an allocation.
    let get = |n: &str, want: usize| -> Result<Vec<f32>> {
        let t = f
            .require(n)
            .with_context(|| format!("{}: no {n}", what()))?;
        let count: u128 = t.shape.iter().map(|&d| d as u128).product();
        if count != want as u128 {
            bail!(
                "{}: {n} holds {count} values, the model takes {want} ({t5_tokens} tokens x \
                 {joint_dim} per token, {pooled_dim} pooled)",
                what()
            );
        }
        Ok(f.read_f32(t)?)
    };
    let e = Embeds {
        pooled: get("pooled_prompt_embeds", pooled_dim)?,
        context: get("prompt_embeds", t5_tokens * joint_dim)?,
    };
    if meta.get(SUM_FIELD)
        != Some(&embeds_sum(
            &f32_to_bytes(&e.pooled),
            &f32_to_bytes(&e.context),
        ))
    {
        bail!("{}: its values do not match their checksum", what());
    }
    Ok(e)
}

/// Stores the encoders' outputs under `key`, with their checksum (one output writer: written
/// whole or not at all).
fn write_embeds(
    path: &std::path::Path,
    key: &str,
    tensors: &std::collections::BTreeMap<String, (Vec<usize>, Vec<f32>)>,
) -> Result<()> {
    let mut named = Vec::new();
    for n in ["pooled_prompt_embeds", "prompt_embeds"] {
        let (shape, v) = tensors.get(n).context("encoder outputs")?;
        named.push((
            n.to_string(),
            Dtype::F32,
            shape.iter().map(|&d| d as u64).collect(),
            f32_to_bytes(v),
        ));
    }
    let meta = std::collections::BTreeMap::from([
        (KEY_FIELD.to_string(), key.to_string()),
        (SUM_FIELD.to_string(), embeds_sum(&named[0].3, &named[1].3)),
    ]);
    nibble_core::format::writer::write_safetensors(path, &named, &meta)
        .with_context(|| format!("embedding cache {}", path.display()))
}

/// The cache folder, made now and checked writable: a path that cannot be a folder is an error
/// before any work, not after the image is made.
fn cache_folder(dir: &std::path::Path) -> Result<()> {
    std::fs::create_dir_all(dir)
        .with_context(|| format!("--embed-cache {}: cannot be a folder", dir.display()))?;
    let probe = dir.join(format!(".nibble-probe-{}", std::process::id()));
    std::fs::write(&probe, b"")
        .with_context(|| format!("--embed-cache {}: cannot write there", dir.display()))?;
    let _ = std::fs::remove_file(&probe);
    Ok(())
}
