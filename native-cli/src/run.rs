//! `nibble run`: generate with a Llama-family model, streamed through the ring on the chosen
//! backend. The plan is printed first (the KV cache is part of it); the prompt runs in one
//! prefill pass, then every generated token is one decode pass over the layers through the KV
//! cache, streamed like a denoising step; text appears as it is generated.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::llama::{
    self, Decoder, GenerateOptions, Generation, LlamaShape, Sampling,
};
use nibble_core::models::text::{TextStream, TextTokenizer};
use nibble_core::models::ModelKind;
use nibble_core::plan::{fmt_bytes, parse_size, Budgets};
use serde_json::json;

/// Options of `nibble run`.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Model path or URL.
    pub model: String,
    /// Prompt text (tokenized with the model's tokenizer.json).
    pub prompt: Option<String>,
    /// Wrap the prompt in the model's chat template as a user message.
    pub chat: bool,
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// Keep generating after an end-of-sequence token.
    pub ignore_eos: bool,
    /// auto, cpu, cpu-ref, wgpu, cuda.
    pub backend: String,
    /// Device budget (None: everything resident).
    pub device_budget: Option<String>,
    /// Ring slots.
    pub slots: u64,
    /// Slot size.
    pub slot_size: String,
    /// Sampling temperature (0: greedy).
    pub temperature: f32,
    /// Keep the k most likely tokens (0: all).
    pub top_k: usize,
    /// Keep the smallest set with this much probability (1: all).
    pub top_p: f32,
    /// Sampling seed.
    pub seed: u64,
    /// Write logits to this safetensors file.
    pub logits_out: Option<std::path::PathBuf>,
    /// Print one JSON object.
    pub json: bool,
    /// Time every op and print the slowest kinds at the end.
    pub profile: bool,
    /// How local files are read.
    pub file_mode: String,
    /// Stream every weight group each step, whatever the budget.
    pub stream_all: bool,
    /// Options of a DiT run.
    pub dit: crate::run_dit::DitRun,
}

/// The model's kind by its config.json.
fn kind(model: &ModelIndex) -> Option<ModelKind> {
    model.config.as_ref().and_then(ModelKind::of_config)
}

/// Runs generation (LLM) or denoising (DiT), by what config.json says, on `o.backend`.
pub fn run(o: &RunOptions) -> Result<()> {
    let model = crate::open_model_with(&o.model, &o.file_mode)?;
    let Some(k) = kind(&model) else {
        bail!(
            "{}: config.json is neither a Llama-family decoder, a Flux-style DiT nor a BERT encoder",
            o.model
        );
    };
    if k != ModelKind::Dit && o.prompt_ids.is_empty() && o.prompt.is_none() {
        bail!("a language model or an encoder needs --prompt TEXT or --prompt-ids 1,2,3");
    }
    crate::backends::select(&o.backend)?.run(Dispatch { o, model: &model })
}

/// The model kind's run on one backend.
struct Dispatch<'a> {
    o: &'a RunOptions,
    model: &'a ModelIndex,
}

impl crate::backends::WithBackend for Dispatch<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, backend: B, label: &str) -> Result<()> {
        match kind(self.model) {
            Some(ModelKind::Llm) => generate(self.o, self.model, backend, label),
            Some(ModelKind::Encoder) => crate::run_embed::run(self.o, self.model, backend, label),
            _ => crate::run_dit::run(self.o, &self.o.dit, self.model, backend, label),
        }
    }
}

/// The executor options of `o`: the device budget given (`default_budget()` without one), the
/// ring.
pub(crate) fn exec_options(
    o: &RunOptions,
    default_budget: impl FnOnce() -> Result<u64>,
) -> Result<ExecOptions> {
    let device_bytes = match &o.device_budget {
        Some(s) => parse_size(s)?,
        None => default_budget()?,
    };
    Ok(ExecOptions {
        budgets: Budgets {
            device_bytes,
            ring_slots: o.slots,
            slot_bytes: parse_size(&o.slot_size)?,
        },
        readers: 2,
        stream_all: o.stream_all,
        naive: false,
    })
}

/// Everything resident: the device bytes the planner lays out with every group resident.
pub(crate) fn resident_budget<B: Backend>(
    graph: &nibble_core::graph::Graph,
    model: &ModelIndex,
    backend: &mut B,
) -> Result<u64> {
    Ok(nibble_core::plan::resident_device_bytes(
        graph, model, backend,
    )?)
}

fn generate<B: Backend>(
    o: &RunOptions,
    model: &ModelIndex,
    mut backend: B,
    label: &str,
) -> Result<()> {
    let cfg = llama::LlamaConfig::of(model)?;
    let sampling = Sampling {
        temperature: o.temperature,
        top_k: o.top_k,
        top_p: o.top_p,
        seed: o.seed,
    };
    sampling.check()?;
    let tokenizer = match (&o.prompt, TextTokenizer::for_model(model)) {
        (Some(_), Err(e)) => return Err(e.into()),
        (_, t) => t.ok(),
    };
    let prompt_ids: Vec<u32> = match (&o.prompt, &tokenizer) {
        (Some(text), Some(tok)) => tok.prompt_ids(text, o.chat)?,
        _ => o.prompt_ids.clone(),
    };
    if prompt_ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    if o.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let capacity = prompt_ids.len() + o.max_tokens;
    if capacity > cfg.max_positions {
        bail!(
            "prompt ({}) + --max-tokens ({}) exceed the model's {} positions",
            prompt_ids.len(),
            o.max_tokens,
            cfg.max_positions
        );
    }
    let shape = LlamaShape {
        prompt: prompt_ids.len(),
        capacity,
        all_logits: o.logits_out.is_some(),
        hidden_states: false,
    };
    let lg = llama::build(model, shape)?;
    let opts = exec_options(o, || resident_budget(&lg.graph, model, &mut backend))?;
    let t_setup = Instant::now();
    let mut dec = Decoder::from_graph(lg, model, backend, opts)
        .with_context(|| format!("planning {} on {label}", o.model))?;
    if !o.json {
        eprintln!("backend {label}");
        eprint!("{}", dec.executor().plan().explain());
        eprintln!(
            "prompt {} tokens, up to {} new; setup {:.0} ms",
            prompt_ids.len(),
            o.max_tokens,
            t_setup.elapsed().as_secs_f64() * 1e3
        );
    }
    dec.executor_mut().set_profile(o.profile);
    let eos = nibble_core::io::folder::block_on(llama::eos_ids(model, &cfg))?;
    let vocab = cfg.vocab;
    let mut gen = Generation::new(
        dec,
        prompt_ids.clone(),
        eos,
        GenerateOptions {
            max_tokens: o.max_tokens,
            stop_at_eos: !o.ignore_eos,
            sampling,
        },
    )?;
    let mut stream = TextStream::default();
    let mut prompt_logits = Vec::new();
    let mut chose: Vec<f32> = Vec::new();
    let (mut bytes_streamed, mut bytes_in_place) = (0u64, 0u64);
    let (mut prefill_s, mut decode_s, mut decode_steps) = (0f64, 0f64, 0usize);
    let mut out = std::io::stdout().lock();
    let mut rss_per_token = Vec::with_capacity(o.max_tokens);
    while let Some(t) = gen.next_token()? {
        bytes_streamed += t.stats.stream.bytes;
        bytes_in_place += t.stats.in_place_bytes;
        if t.index == 0 {
            prefill_s = t.wall.as_secs_f64();
        } else {
            decode_s += t.wall.as_secs_f64();
            decode_steps += 1;
        }
        if o.logits_out.is_some() {
            let l = gen.logits();
            if t.index == 0 {
                prompt_logits = l.to_vec();
            }
            chose.extend_from_slice(&l[l.len() - vocab..]);
        }
        rss_per_token.push(nibble_core::plan::machine::rss_bytes().unwrap_or(0));
        if !o.json {
            let piece = match &tokenizer {
                Some(tok) => stream.push(tok, t.id)?,
                None => format!("{} ", t.id),
            };
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        }
    }
    let generated = gen.tokens().to_vec();
    let prefill_tok_s = prompt_ids.len() as f64 / prefill_s.max(1e-9);
    let decode_tok_s = decode_steps as f64 / decode_s.max(1e-9);
    let rss_max = nibble_core::plan::machine::peak_rss_bytes().unwrap_or(0);
    if let Some(path) = &o.logits_out {
        use nibble_core::format::dtype::{f32_to_bytes, Dtype};
        let n = generated.len() as u64;
        nibble_core::format::writer::write_safetensors(
            path,
            &[
                (
                    "logits".into(),
                    Dtype::F32,
                    vec![prompt_ids.len() as u64, vocab as u64],
                    f32_to_bytes(&prompt_logits),
                ),
                (
                    "step_logits".into(),
                    Dtype::F32,
                    vec![n, vocab as u64],
                    f32_to_bytes(&chose),
                ),
            ],
            &Default::default(),
        )?;
    }
    let dec = gen.into_decoder();
    if o.profile {
        crate::run::print_profile(&dec.executor().profile());
    }
    let text = match &tokenizer {
        Some(tok) => Some(tok.decode(&generated, true)?),
        None => None,
    };
    if o.json {
        let v = json!({
            "tokens": generated,
            "prompt_ids": prompt_ids,
            "text": text,
            "prefill_tok_s": prefill_tok_s,
            "decode_tok_s": decode_tok_s,
            "rss_max_bytes": rss_max,
            "bytes_streamed": bytes_streamed,
            "bytes_in_place": bytes_in_place,
            "rss_bytes_per_token": rss_per_token,
            "plan": {
                "resident_groups": dec.executor().plan().counts().0,
                "streamed_groups": dec.executor().plan().counts().1,
                "device_bytes": dec.executor().plan().peak_device_bytes,
            },
        });
        crate::write_stdout(&format!("{v}\n"))?;
    } else {
        let _ = writeln!(out);
        eprintln!(
            "prefill {} tokens at {:.1} tok/s; decode {} tokens at {:.2} tok/s; peak RSS {}; streamed {}{}",
            prompt_ids.len(),
            prefill_tok_s,
            decode_steps,
            decode_tok_s,
            fmt_bytes(rss_max),
            fmt_bytes(bytes_streamed),
            if bytes_in_place > 0 {
                format!(" ({} of it read in place from the ring)", fmt_bytes(bytes_in_place))
            } else {
                String::new()
            }
        );
    }
    Ok(())
}

/// Prints an op profile (slowest first) to stderr.
pub fn print_profile(p: &[(String, u64, std::time::Duration)]) {
    let total: f64 = p.iter().map(|x| x.2.as_secs_f64()).sum();
    eprintln!("op profile ({:.1} ms in ops):", total * 1e3);
    for (name, calls, t) in p.iter().take(20) {
        eprintln!(
            "  {:>9.2} ms {:>5.1}%  {:>7} calls  {:>8.1} us/call  {name}",
            t.as_secs_f64() * 1e3,
            t.as_secs_f64() * 100.0 / total.max(1e-12),
            calls,
            t.as_secs_f64() * 1e6 / (*calls).max(1) as f64
        );
    }
}
