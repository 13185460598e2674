//! The options of `nibble run` and what every model kind derives from them: the executor options,
//! from core's one budget decision.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
pub(crate) use nibble_core::plan::budget::BudgetNote;
use nibble_core::plan::budget::{BudgetDecision, Machine};

use crate::args::{BackendArg, FileModeArg, MemoryArgs};

/// Options of `nibble run`.
#[derive(Debug, Clone, Args)]
pub struct RunArgs {
    /// Model folder, `.safetensors` file, or http(s) URL of either.
    #[arg(long)]
    pub model: String,
    /// Backend that runs the ops.
    #[arg(long, value_enum, default_value_t)]
    pub backend: BackendArg,
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// How local files are read.
    #[arg(long, value_enum, default_value_t)]
    pub file_mode: FileModeArg,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
    /// Time every op and print the slowest op kinds at the end.
    #[arg(long)]
    pub profile: bool,
    /// Seed of sampling (language models) and of random inputs (DiTs).
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    #[command(flatten)]
    pub text: TextArgs,
    #[command(flatten)]
    pub llm: LlmArgs,
    #[command(flatten)]
    pub dit: DitArgs,
    #[command(flatten)]
    pub lora: crate::args::LoraArgs,
    /// `nibble plan`: print the plans and stop before anything is allocated or read.
    #[arg(skip)]
    pub plan_only: bool,
}

/// The prompt of a language model or an encoder.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Language models and encoders")]
pub struct TextArgs {
    /// Prompt text (tokenized with the model's tokenizer.json).
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// Send the prompt as a user message through the model's chat template.
    #[arg(long, requires = "prompt")]
    pub chat: bool,
    /// Prompt token ids, comma separated (for models without a tokenizer).
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Vec<u32>,
}

/// Token generation.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "Language models")]
pub struct LlmArgs {
    /// Tokens to generate.
    #[arg(long, default_value_t = 16)]
    pub max_tokens: usize,
    /// Keep generating after an end-of-sequence token.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Sampling temperature (0: greedy).
    #[arg(long, default_value_t = 0.0, value_parser = crate::args::finite_f32)]
    pub temperature: f32,
    /// Sample among the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Sample among the most likely tokens holding this probability (1: all).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::finite_f32)]
    pub top_p: f32,
    /// Write float32 logits (`logits` [prompt, vocab], `step_logits` [n, vocab]).
    #[arg(long, value_name = "FILE")]
    pub logits_out: Option<PathBuf>,
}

/// Denoising with a Flux-style DiT, alone or in a Flux pipeline folder, and text to video from a
/// Wan folder.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "DiTs, Flux pipelines and Wan video")]
pub struct DitArgs {
    /// Denoising steps [default: 28; 50 for a Wan folder].
    #[arg(long, value_parser = crate::args::steps)]
    pub steps: Option<usize>,
    /// A Wan folder's frames (4k + 1) [default: 81].
    #[arg(long)]
    pub frames: Option<usize>,
    /// A Wan folder's negative prompt (none: "", as diffusers).
    #[arg(long, value_name = "TEXT")]
    pub negative_prompt: Option<String>,
    /// A Wan folder's video as PNG frames in this folder (frame_0000.png, ...).
    #[arg(long, value_name = "DIR")]
    pub frames_dir: Option<PathBuf>,
    /// A Wan video's frame rate in its MP4 [default: 16, Wan 2.1's].
    #[arg(long, value_parser = crate::args::finite)]
    pub fps: Option<f64>,
    /// Inputs (hidden_states, encoder_hidden_states, pooled_projections, guidance, img_ids,
    /// txt_ids); random from --seed otherwise.
    #[arg(long, value_name = "FILE")]
    pub inputs: Option<PathBuf>,
    /// A pipeline's image height in pixels [default: 1024; 480 for a Wan folder]; a lone DiT's
    /// latent grid height in tokens (random inputs) [default: 4].
    #[arg(long)]
    pub height: Option<usize>,
    /// A pipeline's image width in pixels [default: 1024; 832 for a Wan folder]; a lone DiT's
    /// latent grid width in tokens (random inputs) [default: 4].
    #[arg(long)]
    pub width: Option<usize>,
    /// A pipeline's T5 tokens (diffusers' `max_sequence_length`).
    #[arg(long, default_value_t = 512)]
    pub max_sequence_length: usize,
    /// A pipeline's initial latents (`latents` or `initial_latents`, packed [1, tokens,
    /// 4 x channels] or [tokens, 4 x channels]) instead of noise from --seed.
    #[arg(long, value_name = "FILE", conflicts_with = "inputs")]
    pub latents: Option<PathBuf>,
    /// Which of torch's CPU noise transforms --seed reproduces: its AVX2 kernel (x86-64
    /// machines with AVX2, the usual case) or its scalar one (ARM, older x86).
    #[arg(long, value_enum, default_value_t = NoiseArg::Avx2)]
    pub torch_noise: NoiseArg,
    /// A pipeline's VAE decodes in overlapping tiles (blended as diffusers' tiled_decode): auto
    /// when the whole image's decoder does not fit the device budget.
    #[arg(long, value_enum, default_value_t = TilingArg::Auto)]
    pub vae_tiling: TilingArg,
    /// VAE tile size. Flux: N latent positions a side (diffusers' tile_latent_min_size; the
    /// image tile is N times the VAE's scale factor) [default: the VAE's sample_size / scale
    /// factor]. Wan: H,W (or N for N,N) in video pixels, as AutoencoderKLWan.enable_tiling's
    /// tile_sample_min_height/width [default: 256,256].
    #[arg(long, value_name = "N|H,W", value_parser = parse_pair)]
    pub vae_tile_size: Option<(usize, usize)>,
    /// Wan: pixels between VAE tile starts, H,W (or N), as enable_tiling's
    /// tile_sample_stride_height/width [default: 192,192]; tiles blend over size - stride.
    #[arg(long, value_name = "N|H,W", value_parser = parse_pair)]
    pub vae_tile_stride: Option<(usize, usize)>,
    /// Wan: decode this latent video (`latents`, [1, z_dim, F, h, w] or [z_dim, F, h, w], the
    /// VAE's own input, already de-normalized) instead of running the prompt.
    #[arg(long, value_name = "LATENTS.safetensors")]
    pub vae_decode: Option<PathBuf>,
    /// A pipeline's cache of text-encoder outputs: a second image from the same prompt (and the
    /// same encoder files and sequence length) skips CLIP and T5 and reads none of their weights.
    #[arg(long, value_name = "DIR")]
    pub embed_cache: Option<PathBuf>,
    /// A pipeline's intermediate tensors (float32): clip_input_ids, t5_input_ids,
    /// pooled_prompt_embeds, prompt_embeds, initial_latents, sigmas, final_latents_packed,
    /// vae_input, image_f32.
    #[arg(long, value_name = "FILE")]
    pub intermediates: Option<PathBuf>,
    /// Text tokens (random inputs).
    #[arg(long, default_value_t = 8)]
    pub text_len: usize,
    /// Guidance scale [default: 3.5 (embedded, Flux); 5.0 for a Wan folder (classifier-free,
    /// off at 1 or below)].
    #[arg(long, value_parser = crate::args::finite_f32)]
    pub guidance: Option<f32>,
    /// Static schedule shift (1: none).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::finite)]
    pub shift: f64,
    /// Resolution-dependent shift, as Flux uses.
    #[arg(long)]
    pub dynamic_shift: bool,
    /// A Flux pipeline's image (PNG); a Wan folder's video (MP4, H.264); a lone DiT's final
    /// latent (`latent`, float32 safetensors).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// PNG of the final latent's first three channels.
    #[arg(long, value_name = "FILE")]
    pub preview: Option<PathBuf>,
    /// Write the latent and step index (a Wan folder: and UniPC's history) into this folder
    /// after every step (atomically).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// Continue from the last complete checkpoint in this folder (a lone DiT: its inputs and
    /// schedule; a Wan folder: the same request, checked; the final latent equals an
    /// uninterrupted run's).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
}

/// The executor options of a run of `graphs` (its phases) and the note saying where its
/// budgets came from: core's one budget decision ([`nibble_core::plan::budget::decide`]) for
/// `m` on this machine, read now.
pub(crate) fn exec_options<B: Backend>(
    m: &MemoryArgs,
    backend: &mut B,
    graphs: &[(&nibble_core::graph::Graph, &ModelIndex)],
) -> Result<(ExecOptions, BudgetNote)> {
    let d = decide(m, backend, graphs)?;
    Ok((ExecOptions::decided(&d, 2), d.note))
}

/// Core's budget decision for `m` on this machine (each phase's plan under it included).
pub(crate) fn decide<B: Backend>(
    m: &MemoryArgs,
    backend: &mut B,
    graphs: &[(&nibble_core::graph::Graph, &ModelIndex)],
) -> Result<BudgetDecision> {
    let machine = Machine::measure();
    Ok(nibble_core::plan::budget::decide(
        &m.request(),
        &machine,
        backend,
        graphs,
    )?)
}

/// Refuses the flags only a Wan folder takes on `model`, which is not one.
pub(crate) fn refuse_wan_flags(d: &DitArgs, model: &str) -> Result<()> {
    let given: Vec<&str> = [
        ("--frames", d.frames.is_some()),
        ("--negative-prompt", d.negative_prompt.is_some()),
        ("--frames-dir", d.frames_dir.is_some()),
        ("--fps", d.fps.is_some()),
        ("--vae-tile-stride", d.vae_tile_stride.is_some()),
        ("--vae-decode", d.vae_decode.is_some()),
    ]
    .into_iter()
    .filter_map(|(f, on)| on.then_some(f))
    .collect();
    if !given.is_empty() {
        anyhow::bail!(
            "{} are for a Wan folder (model_index.json naming WanPipeline); {model} is not one",
            given.join(", ")
        );
    }
    Ok(())
}

/// `N` (as `N,N`) or `H,W`, each a positive count.
fn parse_pair(s: &str) -> std::result::Result<(usize, usize), String> {
    let one = |t: &str| match t.trim().parse::<usize>() {
        Ok(n) if n > 0 => Ok(n),
        _ => Err(format!("{s:?}: give N or H,W (positive whole numbers)")),
    };
    match s.split_once(',') {
        Some((h, w)) => Ok((one(h)?, one(w)?)),
        None => one(s).map(|n| (n, n)),
    }
}

/// Which of torch's noise transforms `--seed` reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum NoiseArg {
    /// torch's AVX2 kernel.
    Avx2,
    /// torch's scalar kernel (the C library's log, sin, cos).
    Scalar,
}

/// Whether a pipeline's VAE decodes in tiles.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TilingArg {
    /// Always (when the latent is larger than one tile).
    On,
    /// Never.
    Off,
    /// When the whole image's decoder does not fit the device budget.
    Auto,
}
