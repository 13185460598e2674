//! The options of `nibble run` and what every model kind derives from them: the executor options
//! and the all-resident default budget.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::plan::Budgets;

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

/// Denoising with a Flux-style DiT, alone or in a Flux pipeline folder.
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "DiTs and Flux pipelines")]
pub struct DitArgs {
    /// Denoising steps.
    #[arg(long, default_value_t = 28)]
    pub steps: usize,
    /// Inputs (hidden_states, encoder_hidden_states, pooled_projections, guidance, img_ids,
    /// txt_ids); random from --seed otherwise.
    #[arg(long, value_name = "FILE")]
    pub inputs: Option<PathBuf>,
    /// A pipeline's image height in pixels [default: 1024]; a lone DiT's latent grid height in
    /// tokens (random inputs) [default: 4].
    #[arg(long)]
    pub height: Option<usize>,
    /// A pipeline's image width in pixels [default: 1024]; a lone DiT's latent grid width in
    /// tokens (random inputs) [default: 4].
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
    /// Latent positions per VAE tile side (diffusers' tile_latent_min_size; the image tile is
    /// this times the VAE's scale factor) [default: the VAE's sample_size / scale factor].
    #[arg(long, value_name = "N")]
    pub vae_tile_size: Option<usize>,
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
    /// Guidance scale (random inputs).
    #[arg(long, default_value_t = 3.5, value_parser = crate::args::finite_f32)]
    pub guidance: f32,
    /// Static schedule shift (1: none).
    #[arg(long, default_value_t = 1.0, value_parser = crate::args::finite)]
    pub shift: f64,
    /// Resolution-dependent shift, as Flux uses.
    #[arg(long)]
    pub dynamic_shift: bool,
    /// A pipeline's image (PNG); a lone DiT's final latent (`latent`, float32 safetensors).
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
    /// PNG of the final latent's first three channels.
    #[arg(long, value_name = "FILE")]
    pub preview: Option<PathBuf>,
    /// Write the latent and step index into this folder after every step (atomically).
    #[arg(long, value_name = "DIR")]
    pub checkpoint: Option<PathBuf>,
    /// Continue from the last complete checkpoint in this folder (its inputs and schedule; the
    /// final latent equals an uninterrupted run's).
    #[arg(long, value_name = "DIR")]
    pub resume: Option<PathBuf>,
}

/// The staging ring: slots of a size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ring {
    slots: u64,
    slot_size: u64,
}

/// The ring nibble starts from where `--slots` or `--slot-size` is `auto`.
const AUTO_SLOTS: u64 = 4;
const AUTO_SLOT_SIZE: u64 = 16 << 20;
/// An automatic ring grows to at most this many bytes, and slots.
const AUTO_RING_MAX: u64 = 1 << 30;
const AUTO_SLOTS_MAX: u64 = 256;
/// A ring that grows has slots of this size (where `--slot-size` is `auto`), and at least this
/// many (where `--slots` is).
const AUTO_GROWN_SLOT_SIZE: u64 = 32 << 20;
const AUTO_GROWN_SLOTS: u64 = 16;

/// The executor options of a run of `graphs` (its phases) and a line saying where its budgets
/// came from: see [`budgets`]. With `--slots` or `--slot-size` `auto`, the ring is 4 x 16 MiB
/// unless a group that the plan streams (or keeps in the host tier, which uploads through the
/// ring too) takes more slots: then it grows to 16 slots of 32 MiB, or more to hold the
/// largest such group, so that reads run on while groups compute instead of the disk idling
/// once a small ring is full, within an eighth of the host budget left after the process,
/// [`AUTO_RING_MAX`] and [`AUTO_SLOTS_MAX`] slots; the budgets are then decided again with it.
pub(crate) fn exec_options<B: Backend>(
    m: &MemoryArgs,
    backend: &mut B,
    graphs: &[(&nibble_core::graph::Graph, &ModelIndex)],
) -> Result<(ExecOptions, BudgetNote)> {
    use nibble_core::plan::fmt_bytes;
    // The backend's state for running the graphs (a GPU backend's compiled and launched
    // kernels) stays with the process: made once, before the budgets measure the process.
    for (g, _) in graphs {
        backend.prepare(g)?;
    }
    let given = Ring {
        slots: m.slots.0.unwrap_or(AUTO_SLOTS),
        slot_size: m.slot_size.0.unwrap_or(AUTO_SLOT_SIZE),
    };
    let (opts, mut note) = budgets(m, given, backend, graphs)?;
    if m.slots.0.is_some() && m.slot_size.0.is_some() {
        return Ok((opts, note));
    }
    // The largest streamed group with slots of `size`: (slots it takes, bytes, name).
    let largest = |backend: &mut B, size: u64| {
        let mut o = opts;
        o.budgets.slot_bytes = size;
        let mut most: Option<(u64, u64, String)> = None;
        for (g, model) in graphs {
            if let Ok(Some(l)) =
                nibble_core::exec::Executor::largest_streamed_group(g, model, backend, o)
            {
                if most.as_ref().is_none_or(|x| (l.0, l.1) > (x.0, x.1)) {
                    most = Some(l);
                }
            }
        }
        most
    };
    let Some((_, need, name)) = largest(backend, given.slot_size).filter(|l| l.0 > given.slots)
    else {
        return Ok((opts, note));
    };
    let room = note
        .host_budget
        .map_or(AUTO_RING_MAX, |h| h.saturating_sub(note.rss_at_plan) / 8);
    let cap = room.min(AUTO_RING_MAX);
    // The ring, and the slots the largest streamed group takes with its slot size.
    let (grown, needs) = match (m.slots.0, m.slot_size.0) {
        // A count given: slots of whole MiB large enough between them, doubled while the
        // group's chunks do not fit them.
        (Some(n), _) => {
            let mut size = need
                .div_ceil(n)
                .next_multiple_of(1 << 20)
                .max(AUTO_SLOT_SIZE);
            while size.saturating_mul(n) <= cap && largest(backend, size).is_some_and(|l| l.0 > n) {
                size = size.saturating_mul(2);
            }
            let size = size.min((cap / n).max(AUTO_SLOT_SIZE));
            let needs = largest(backend, size).map_or(0, |l| l.0);
            (
                Ring {
                    slots: n,
                    slot_size: size,
                },
                needs,
            )
        }
        // 32 MiB slots, at least 16 of them (fewer or smaller left the disk idle, measured on
        // a 35 GiB synthetic Llama of 100 MiB layers read from disk: 16 x 32 MiB 11.7 s a
        // token, 10 x 16 MiB 16.8-18.9 s, 32 x 16 MiB 15.6 s), more where the largest group
        // takes more.
        (None, given_size) => {
            let size = given_size.unwrap_or(AUTO_GROWN_SLOT_SIZE);
            let needs = largest(backend, size).map_or(0, |l| l.0);
            let slots = if needs == 0 {
                AUTO_SLOTS
            } else {
                needs.max(AUTO_GROWN_SLOTS)
            };
            let ring = Ring {
                slots: slots.min(cap / size).clamp(AUTO_SLOTS, AUTO_SLOTS_MAX),
                slot_size: size,
            };
            (ring, needs)
        }
    };
    let bytes = grown.slots.saturating_mul(grown.slot_size);
    if bytes <= given.slots.saturating_mul(given.slot_size) {
        return Ok((opts, note));
    }
    let holds = needs <= grown.slots;
    // A ring the budgets cannot hold leaves the run with the smaller one.
    let (opts2, mut note2) = match budgets(m, grown, backend, graphs) {
        Ok(r) => r,
        Err(e) => {
            note.note.push_str(&format!(
                "; ring {} x {}: the largest streamed group ({name}, {}) does not fit it, and \
                 a ring that would does not fit the budgets ({e})",
                given.slots,
                fmt_bytes(given.slot_size),
                fmt_bytes(need)
            ));
            // The second planning may have left the process larger.
            let rss = nibble_core::io::machine::rss_bytes().unwrap_or(0);
            note.rss_at_plan = note.rss_at_plan.max(rss);
            return Ok((opts, note));
        }
    };
    note2.note.push_str(&format!(
        "; ring auto {} x {} = {}: {} the largest streamed group ({name}, {}){}",
        grown.slots,
        fmt_bytes(grown.slot_size),
        fmt_bytes(bytes),
        if holds { "holds" } else { "capped below" },
        fmt_bytes(need),
        if holds {
            String::new()
        } else {
            format!(
                " (at most {} and {AUTO_SLOTS_MAX} slots: an eighth of the host budget left \
                 after the process, 1 GiB)",
                fmt_bytes(cap)
            )
        }
    ));
    Ok((opts2, note2))
}

/// The executor options of a run of `graphs` (its phases) with this ring and a line saying
/// where the device budget came from: the size given, or `auto`: every weight of the largest
/// phase resident, capped on a backend whose device memory is host memory (the CPU backends) by
/// the host budget less the ring and the process's memory now. Each phase's plan must then fit
/// the host budget with the process's memory (its device bytes count too where they are host
/// memory); a run that would not is refused before anything is allocated or read.
fn budgets<B: Backend>(
    m: &MemoryArgs,
    r: Ring,
    backend: &mut B,
    graphs: &[(&nibble_core::graph::Graph, &ModelIndex)],
) -> Result<(ExecOptions, BudgetNote)> {
    let resident = |backend: &mut B| -> Result<u64> {
        let mut most = 0;
        for (g, model) in graphs {
            most = most.max(nibble_core::plan::resident_device_bytes(g, model, backend)?);
        }
        Ok(most)
    };
    use crate::args::Budget;
    use nibble_core::plan::fmt_bytes;
    let ring = r.slots.saturating_mul(r.slot_size);
    // The planner's own memory (its index of every tensor, the layouts it tries: tens of MiB
    // for a model of thousands of tensors) stays with the process once it has planned: plan
    // each phase once before measuring, so that the measure, and with it the prediction of the
    // peak, includes it. A model the planner refuses is reported below.
    // Likewise the backend's state for running them, made ready by `exec_options` first.
    for (g, model) in graphs {
        if let Ok(least) = nibble_core::plan::min_device_bytes(g, model, backend) {
            let _ = nibble_core::exec::Executor::plan_only(g, model, backend, options(m, r, least));
        }
    }
    let rss = nibble_core::io::machine::rss_bytes().unwrap_or(0);
    let (host, host_note) = match m.host_budget {
        Budget::Bytes(b) => (Some(b), format!("host budget {} (given)", fmt_bytes(b))),
        // What is available now is in addition to what this process already holds.
        Budget::Auto => match nibble_core::io::machine::host_memory() {
            Some(h) => (
                Some(h.budget() + rss),
                format!(
                    "host budget auto {} (the process's {} + {}; margin {})",
                    fmt_bytes(h.budget() + rss),
                    fmt_bytes(rss),
                    h.source,
                    fmt_bytes(h.margin())
                ),
            ),
            None => (None, "host memory unknown on this system".to_string()),
        },
    };
    if let Some(h) = host {
        if rss.saturating_add(ring) > h {
            anyhow::bail!(
                "{host_note} cannot hold the process ({}) and the ring ({} x {} = {})",
                fmt_bytes(rss),
                r.slots,
                fmt_bytes(r.slot_size),
                fmt_bytes(ring)
            );
        }
    }
    let shares_host = backend.host_memory().is_some();
    // The device's memory is RAM here too (a CPU renderer, an integrated GPU), though its
    // buffers are its own.
    let device_in_ram = shares_host || backend.device_memory_is_host();
    let (device_bytes, note) = match m.device_budget {
        Budget::Bytes(b) => (
            b,
            format!("device budget {} (given); {host_note}", fmt_bytes(b)),
        ),
        Budget::Auto => {
            let need = resident(backend)?;
            match host.filter(|_| shares_host) {
                Some(h) => {
                    // The host budget less the process and the ring, less what the plans add
                    // besides (loader and kernel buffers), found by planning.
                    let mut room = h - rss - ring;
                    for _ in 0..3 {
                        let mut host_bytes = ring;
                        for (g, model) in graphs {
                            let o = options(m, r, room.min(need));
                            if let Ok(p) =
                                nibble_core::exec::Executor::plan_only(g, model, backend, o)
                            {
                                host_bytes = host_bytes.max(p.peak_host_bytes);
                            }
                        }
                        // The device memory allocated never exceeds its budget.
                        let fits = h.saturating_sub(rss).saturating_sub(host_bytes);
                        if fits >= room {
                            break;
                        }
                        room = fits;
                    }
                    let mut least = 0;
                    for (g, model) in graphs {
                        least = least.max(nibble_core::plan::min_device_bytes(g, model, backend)?);
                    }
                    if room.min(need) < least {
                        anyhow::bail!(
                            "the {host_note} leaves {} for device memory (host memory on this \
                             backend) after the process ({}) and the ring ({} x {}) and their \
                             buffers; the run needs at least {} with every group streamed: give \
                             a larger --host-budget, or fewer or smaller ring slots",
                            fmt_bytes(room),
                            fmt_bytes(rss),
                            r.slots,
                            fmt_bytes(r.slot_size),
                            fmt_bytes(least)
                        );
                    }
                    if need <= room {
                        (
                            need,
                            format!(
                                "device budget auto {}: every weight resident, within the {host_note}",
                                fmt_bytes(need)
                            ),
                        )
                    } else {
                        (
                            room,
                            format!(
                                "device budget auto {}: the {host_note} less the process ({}) and the \
                                 ring ({}), on this backend device memory is host memory; every \
                                 weight resident would need {}",
                                fmt_bytes(room),
                                fmt_bytes(rss),
                                fmt_bytes(ring),
                                fmt_bytes(need)
                            ),
                        )
                    }
                }
                None => match backend.device_memory() {
                    // The driver's free memory less a margin of a tenth of the total (at least
                    // 256 MiB): what the other users of the device and its driver keep.
                    Some((free, total)) => {
                        let margin = (total / 10).max(256 << 20);
                        let cap = free.saturating_sub(margin);
                        if need <= cap {
                            (
                                need,
                                format!(
                                    "device budget auto {}: every weight resident, within the \
                                     device's free {} of {} less a margin of {}; {host_note}",
                                    fmt_bytes(need),
                                    fmt_bytes(free),
                                    fmt_bytes(total),
                                    fmt_bytes(margin)
                                ),
                            )
                        } else {
                            (
                                cap,
                                format!(
                                    "device budget auto {}: the device's free {} of {} less a \
                                     margin of {}; every weight resident would need {}; \
                                     {host_note}",
                                    fmt_bytes(cap),
                                    fmt_bytes(free),
                                    fmt_bytes(total),
                                    fmt_bytes(margin),
                                    fmt_bytes(need)
                                ),
                            )
                        }
                    }
                    None => limited_auto(backend, need, &host_note),
                },
            }
        }
    };
    let (device_bytes, note) = match (m.device_budget, host) {
        (Budget::Auto, Some(h)) if device_in_ram && !shares_host => {
            // The auto budget above is the device's; its memory is RAM, so the host budget
            // bounds it too.
            let mut host_bytes = ring;
            for (g, model) in graphs {
                if let Ok(p) = nibble_core::exec::Executor::plan_only(
                    g,
                    model,
                    backend,
                    options(m, r, device_bytes),
                ) {
                    host_bytes = host_bytes.max(p.peak_host_bytes);
                }
            }
            let room = h.saturating_sub(rss).saturating_sub(host_bytes);
            if device_bytes > room {
                (
                    room,
                    format!(
                        "{note}; capped at {}: the device's memory is RAM (a CPU renderer or an \
                         integrated GPU), within the host budget less the process and the plan's \
                         host buffers",
                        fmt_bytes(room)
                    ),
                )
            } else {
                (device_bytes, note)
            }
        }
        _ => (device_bytes, note),
    };
    let mut opts = options(m, r, device_bytes);
    let mut note = note;
    if m.stream_all {
        note.push_str("; --stream-all: every weight group streams whatever the budget holds");
    }
    if let (Some(h), false) = (host, shares_host) {
        // The host tier: what the host budget holds besides the process and each phase's
        // ring, loader and kernel buffers keeps streamed groups in RAM after their first read.
        let mut room = u64::MAX;
        let mut streams = false;
        for (g, model) in graphs {
            if let Ok(plan) = nibble_core::exec::Executor::plan_only(g, model, backend, opts) {
                streams |= plan.counts().1 > 0;
                room = room.min(
                    h.saturating_sub(rss)
                        .saturating_sub(plan.host_bytes_with_device()),
                );
            }
        }
        if streams && room != u64::MAX && room > 0 {
            opts.budgets.host_tier_bytes = room;
            note.push_str(&format!(
                "; host tier up to {} for groups the device budget does not hold",
                fmt_bytes(room)
            ));
        }
    }
    if let Some(h) = host {
        for (g, model) in graphs {
            // A budget the planner refuses is reported by the run itself, with its minimum.
            let Ok(plan) = nibble_core::exec::Executor::plan_only(g, model, backend, opts) else {
                continue;
            };
            let need = rss.saturating_add(plan.host_bytes_with_device());
            if need > h {
                anyhow::bail!(
                    "the plan needs {} of host memory (the process {} + ring, loader and kernel \
                     buffers {}{}), over the {host_note}: give a smaller --device-budget, \
                     --slots or --slot-size, or a larger --host-budget",
                    fmt_bytes(need),
                    fmt_bytes(rss),
                    fmt_bytes(plan.peak_host_bytes),
                    if plan.device_in_host_memory {
                        format!(
                            " + device memory, which is host memory here, {}",
                            fmt_bytes(plan.peak_device_bytes)
                        )
                    } else {
                        String::new()
                    }
                );
            }
        }
    }
    Ok((
        opts,
        BudgetNote {
            note,
            rss_at_plan: rss,
            host_budget: host,
            device_budget: device_bytes,
        },
    ))
}

/// The executor options of `m` with this device budget (no host tier yet).
fn options(m: &MemoryArgs, r: Ring, device_bytes: u64) -> ExecOptions {
    ExecOptions {
        budgets: Budgets {
            device_bytes,
            ring_slots: r.slots,
            slot_bytes: r.slot_size,
            host_tier_bytes: 0,
        },
        readers: 2,
        stream_all: m.stream_all,
        naive: false,
    }
}

/// Where a run's budgets came from.
#[derive(Debug, Clone)]
pub(crate) struct BudgetNote {
    /// One line for the plan's printout.
    pub note: String,
    /// The process's RSS when the budgets were decided.
    pub rss_at_plan: u64,
    /// The host budget, where known.
    pub host_budget: Option<u64>,
    /// The device budget decided.
    pub device_budget: u64,
}

impl BudgetNote {
    /// As `--json` reports it.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "note": self.note,
            "rss_at_plan_bytes": self.rss_at_plan,
            "host_budget_bytes": self.host_budget,
            "device_budget_bytes": self.device_budget,
        })
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

/// `--device-budget auto` on a device that tells limits, not free memory (a wgpu adapter): every
/// weight resident within a stated fraction of its allocation limit, else that fraction.
fn limited_auto<B: Backend>(backend: &B, need: u64, host_note: &str) -> (u64, String) {
    use nibble_core::plan::fmt_bytes;
    let (num, den) = nibble_core::backend::AUTO_LIMIT_FRACTION;
    match backend.device_memory_limit() {
        Some((limit, what)) => {
            let cap = limit / den * num;
            let said = format!(
                "{num}/{den} of the adapter's {what} of {} (it does not tell its free memory: \
                 give --device-budget to set it)",
                fmt_bytes(limit)
            );
            if need <= cap {
                (
                    need,
                    format!(
                        "device budget auto {}: every weight resident, within {said}; {host_note}",
                        fmt_bytes(need)
                    ),
                )
            } else {
                (
                    cap,
                    format!(
                        "device budget auto {}: {said}; every weight resident would need {}; \
                         {host_note}",
                        fmt_bytes(cap),
                        fmt_bytes(need)
                    ),
                )
            }
        }
        None => (
            need,
            format!(
                "device budget auto {}: every weight resident (this device does not tell its \
                 free memory: give --device-budget to cap it); {host_note}",
                fmt_bytes(need)
            ),
        ),
    }
}
