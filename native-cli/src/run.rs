//! `nibble run`: generate with a Llama-family model, streamed through the ring on the chosen
//! backend. The plan is printed first; tokens appear as they are generated.
//!
//! This first version runs the decoder over a fixed window (prompt + max tokens, later positions
//! padded; the attention is causal, so they do not change earlier logits): one executor, one
//! memory plan, and every generated token is one pass over the layers, streamed like a
//! denoising step. There is no KV cache yet, so each pass recomputes the window.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use nibble_core::backend::{Backend, CpuRefBackend};
use nibble_core::executor::{ExecOptions, Executor};
use nibble_core::graph::HostTensor;
use nibble_core::index::ModelIndex;
use nibble_core::models::llama;
use nibble_core::plan::{fmt_bytes, parse_size, Budgets};
use serde_json::json;

/// Options of `nibble run`.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Model path or URL.
    pub model: String,
    /// Prompt token ids.
    pub prompt_ids: Vec<u32>,
    /// Tokens to generate.
    pub max_tokens: usize,
    /// auto, cpu, wgpu, cuda.
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
    /// Options of a DiT run.
    pub dit: crate::run_dit::DitRun,
}

struct Sampler(u64);

impl Sampler {
    fn uniform(&mut self) -> f32 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 >> 40) as f32 / (1u64 << 24) as f32
    }

    fn pick(&mut self, logits: &[f32], o: &RunOptions) -> u32 {
        let argmax = || {
            (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap_or(0) as u32
        };
        if o.temperature <= 0.0 {
            return argmax();
        }
        let mut idx: Vec<usize> = (0..logits.len()).collect();
        idx.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        if o.top_k > 0 {
            idx.truncate(o.top_k);
        }
        let m = logits[idx[0]];
        let mut p: Vec<f32> = idx
            .iter()
            .map(|&i| ((logits[i] - m) / o.temperature).exp())
            .collect();
        let sum: f32 = p.iter().sum();
        p.iter_mut().for_each(|x| *x /= sum);
        let mut cum = 0.0;
        let mut keep = p.len();
        for (i, x) in p.iter().enumerate() {
            cum += x;
            if cum >= o.top_p {
                keep = i + 1;
                break;
            }
        }
        let total: f32 = p[..keep].iter().sum();
        let mut r = self.uniform() * total;
        for (i, x) in p[..keep].iter().enumerate() {
            r -= x;
            if r <= 0.0 {
                return idx[i] as u32;
            }
        }
        idx[keep - 1] as u32
    }
}

/// A decoder-only language model: an `*ForCausalLM` architecture, or a Llama-family model type.
fn is_llm(model: &ModelIndex) -> bool {
    model.config.as_ref().is_some_and(|c| {
        let causal = c
            .get("architectures")
            .and_then(|a| a.as_array())
            .is_some_and(|a| {
                a.iter()
                    .any(|x| x.as_str().is_some_and(|s| s.ends_with("ForCausalLM")))
            });
        let family = c
            .get("model_type")
            .and_then(|m| m.as_str())
            .is_some_and(|m| ["llama", "mistral", "qwen2", "smollm"].contains(&m));
        causal || family
    })
}

fn is_dit(model: &ModelIndex) -> bool {
    model.config.as_ref().is_some_and(|c| {
        c.get("num_single_layers").is_some() && c.get("joint_attention_dim").is_some()
    })
}

/// Runs generation (LLM) or denoising (DiT), by what config.json says, on `o.backend`.
pub fn run(o: &RunOptions) -> Result<()> {
    let model = crate::open_model(&o.model)?;
    if !is_llm(&model) && !is_dit(&model) {
        bail!(
            "{}: config.json is neither a Llama-family decoder nor a Flux-style DiT",
            o.model
        );
    }
    if is_llm(&model) && o.prompt_ids.is_empty() {
        bail!("--prompt-ids is required for a language model");
    }
    match o.backend.as_str() {
        "cpu" => dispatch(o, &model, CpuRefBackend::new(), "cpu_ref"),
        "wgpu" => {
            let b = nibble_wgpu::WgpuBackend::new()?;
            let label = format!("wgpu: {}", b.describe());
            dispatch(o, &model, b, &label)
        }
        "cuda" => {
            let b = nibble_cuda::CudaBackend::new()?;
            let label = format!("cuda: {}", b.describe());
            dispatch(o, &model, b, &label)
        }
        "auto" => {
            if let Ok(b) = nibble_cuda::CudaBackend::new() {
                let label = format!("cuda: {}", b.describe());
                return dispatch(o, &model, b, &label);
            }
            match nibble_wgpu::WgpuBackend::new() {
                Ok(b) => {
                    let label = format!("wgpu: {}", b.describe());
                    dispatch(o, &model, b, &label)
                }
                Err(e) => {
                    eprintln!("no GPU backend ({e}); using the CPU reference backend");
                    dispatch(o, &model, CpuRefBackend::new(), "cpu_ref")
                }
            }
        }
        other => bail!("--backend '{other}': expected auto, cpu, wgpu or cuda"),
    }
}

fn dispatch<B: Backend>(o: &RunOptions, model: &ModelIndex, backend: B, label: &str) -> Result<()> {
    if is_llm(model) {
        generate(o, model, backend, label)
    } else {
        crate::run_dit::run(o, &o.dit, model, backend, label)
    }
}

fn generate<B: Backend>(o: &RunOptions, model: &ModelIndex, backend: B, label: &str) -> Result<()> {
    let window = o.prompt_ids.len() + o.max_tokens;
    let lg = llama::build(model, window)?;
    let cfg = lg.config.clone();
    if let Some(bad) = o.prompt_ids.iter().find(|&&t| t as usize >= cfg.vocab) {
        bail!(
            "prompt token id {bad} is outside the vocabulary of {}",
            cfg.vocab
        );
    }
    let slot_bytes = parse_size(&o.slot_size)?;
    let device_bytes = match &o.device_budget {
        Some(s) => parse_size(s)?,
        None => lg.graph.group_bytes(model)?.iter().sum::<u64>() + lg.graph.activation_bytes() * 2,
    };
    let budgets = Budgets {
        device_bytes,
        ring_slots: o.slots,
        slot_bytes,
        host_cache_bytes: 0,
        device_other_bytes: 0,
        host_other_bytes: 0,
    };
    let t_setup = Instant::now();
    let mut ex = Executor::new(
        lg.graph,
        model,
        backend,
        ExecOptions {
            budgets,
            readers: 2,
        },
    )
    .with_context(|| format!("planning {} on {label}", o.model))?;
    if !o.json {
        eprintln!("backend {label}");
        eprint!("{}", ex.plan().explain());
        eprintln!("setup {:.0} ms", t_setup.elapsed().as_secs_f64() * 1e3);
    }
    let (cos, sin) = cfg.rope_tables(window);
    let half = cfg.head_dim / 2;
    let cos = HostTensor::f32(&[window, half], cos)?;
    let sin = HostTensor::f32(&[window, half], sin)?;
    let mut seq = o.prompt_ids.clone();
    let mut sampler = Sampler(o.seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    let mut prompt_logits = Vec::new();
    // The logits that chose each generated token.
    let mut chose: Vec<f32> = Vec::new();
    let mut generated = Vec::new();
    let mut bytes_streamed = 0u64;
    let (mut prefill_s, mut decode_s) = (0.0f64, 0.0f64);
    let mut rss_max = 0u64;
    for step in 0..=o.max_tokens {
        let mut ids = seq.clone();
        ids.resize(window, 0);
        let t = Instant::now();
        let (out, stats) =
            ex.step(&[HostTensor::u32(&[window], ids)?, cos.clone(), sin.clone()])?;
        let dt = t.elapsed().as_secs_f64();
        bytes_streamed += stats.stream.bytes;
        rss_max = rss_max.max(nibble_core::sys::rss_bytes().unwrap_or(0));
        let logits = out[0].as_f32();
        let last = &logits[(seq.len() - 1) * cfg.vocab..seq.len() * cfg.vocab];
        if step == 0 {
            prefill_s = dt;
            prompt_logits = logits[..seq.len() * cfg.vocab].to_vec();
        } else {
            decode_s += dt;
        }
        if step == o.max_tokens {
            break;
        }
        chose.extend_from_slice(last);
        let next = sampler.pick(last, o);
        seq.push(next);
        generated.push(next);
        if !o.json {
            print!("{next} ");
            use std::io::Write;
            let _ = std::io::stdout().flush();
        }
    }
    let prefill_tok_s = o.prompt_ids.len() as f64 / prefill_s.max(1e-9);
    let decode_tok_s = o.max_tokens as f64 / decode_s.max(1e-9);
    if let Some(path) = &o.logits_out {
        use nibble_core::convert::f32_to_bytes;
        use nibble_core::index::Dtype;
        let n = generated.len() as u64;
        nibble_core::writer::write_safetensors(
            path,
            &[
                (
                    "logits".into(),
                    Dtype::F32,
                    vec![o.prompt_ids.len() as u64, cfg.vocab as u64],
                    f32_to_bytes(&prompt_logits),
                ),
                (
                    "step_logits".into(),
                    Dtype::F32,
                    vec![n, cfg.vocab as u64],
                    f32_to_bytes(&chose),
                ),
            ],
            &Default::default(),
        )?;
    }
    if o.json {
        let v = json!({
            "tokens": generated,
            "text": null,
            "prefill_tok_s": prefill_tok_s,
            "decode_tok_s": decode_tok_s,
            "rss_max_bytes": rss_max,
            "bytes_streamed": bytes_streamed,
        });
        crate::write_stdout(&format!("{v}\n"))?;
    } else {
        println!();
        eprintln!(
            "prefill {:.1} tok/s, decode {:.2} tok/s, peak RSS {}, streamed {} (no KV cache yet: each token recomputes a window of {window})",
            prefill_tok_s,
            decode_tok_s,
            fmt_bytes(rss_max),
            fmt_bytes(bytes_streamed)
        );
    }
    Ok(())
}
