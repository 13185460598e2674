//! `nibble run` on a Llama-family decoder: the plan (the KV cache is part of it), the prompt in
//! one prefill pass, then every generated token one decode pass over the layers through the KV
//! cache, streamed like a denoising step, through core's generation loop; text appears as it is
//! generated.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use nibble_core::backend::Backend;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::llama::{
    self, Decoder, GenerateOptions, Generation, LlamaShape, Sampling,
};
use nibble_core::models::text::{TextStream, TextTokenizer};
use nibble_core::plan::fmt_bytes;
use serde_json::json;

use super::options::RunArgs;

pub(super) fn run<B: Backend>(
    o: &RunArgs,
    model: &ModelIndex,
    mut backend: B,
    label: &str,
) -> Result<()> {
    let cfg = llama::LlamaConfig::of(model)?;
    let sampling = Sampling {
        temperature: o.llm.temperature,
        top_k: o.llm.top_k,
        top_p: o.llm.top_p,
        seed: o.seed,
    };
    sampling.check()?;
    let tokenizer = match (&o.text.prompt, TextTokenizer::for_model(model)) {
        (Some(_), Err(e)) => return Err(e.into()),
        (_, t) => t.ok(),
    };
    let prompt_ids: Vec<u32> = match (&o.text.prompt, &tokenizer) {
        (Some(text), Some(tok)) => tok.prompt_ids(text, o.text.chat)?,
        _ => o.text.prompt_ids.clone(),
    };
    // `nibble plan` without a prompt: the plan of a one-token prompt.
    let prompt_ids = if prompt_ids.is_empty() && o.plan_only {
        vec![0]
    } else {
        prompt_ids
    };
    if prompt_ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    if o.llm.max_tokens == 0 {
        bail!("--max-tokens must be at least 1");
    }
    let capacity = prompt_ids.len().saturating_add(o.llm.max_tokens);
    if capacity > cfg.max_positions {
        bail!(
            "prompt ({}) + --max-tokens ({}) exceed the model's {} positions",
            prompt_ids.len(),
            o.llm.max_tokens,
            cfg.max_positions
        );
    }
    let shape = LlamaShape {
        prompt: prompt_ids.len(),
        capacity,
        all_logits: o.llm.logits_out.is_some(),
        hidden_states: false,
    };
    let lg = llama::build(model, shape)?;
    let Some((opts, budget_note)) =
        super::plan::prelude(o, &mut backend, label, "decoder", &lg.graph, model)?
    else {
        return Ok(());
    };
    let t_setup = Instant::now();
    let mut dec = Decoder::from_graph(lg, model, backend, opts)
        .with_context(|| format!("planning {} on {label}", o.model))?;
    super::plan::announce(o, label, &budget_note, dec.executor().plan());
    if !o.json {
        eprintln!(
            "prompt {} tokens, up to {} new; setup {:.0} ms",
            prompt_ids.len(),
            o.llm.max_tokens,
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
            max_tokens: o.llm.max_tokens,
            stop_at_eos: !o.llm.ignore_eos,
            sampling,
        },
    )?;
    let mut stream = TextStream::default();
    let mut prompt_logits = Vec::new();
    let mut chose: Vec<f32> = Vec::new();
    let (mut bytes_streamed, mut bytes_in_place) = (0u64, 0u64);
    let (mut prefill_s, mut decode_s, mut decode_steps) = (0f64, 0f64, 0usize);
    let mut out = std::io::stdout().lock();
    let mut rss_per_token = Vec::with_capacity(o.llm.max_tokens);
    let (mut source_per_step, mut host_per_step) = (Vec::new(), Vec::new());
    while let Some(t) = gen.next_token()? {
        source_per_step.push(t.stats.source_bytes);
        host_per_step.push(t.stats.host_bytes);
        bytes_streamed += t.stats.stream.bytes;
        bytes_in_place += t.stats.in_place_bytes;
        if t.index == 0 {
            prefill_s = t.wall.as_secs_f64();
        } else {
            decode_s += t.wall.as_secs_f64();
            decode_steps += 1;
        }
        if o.llm.logits_out.is_some() {
            let l = gen.logits();
            if t.index == 0 {
                prompt_logits = l.to_vec();
            }
            chose.extend_from_slice(&l[l.len() - vocab..]);
        }
        rss_per_token.push(nibble_core::io::machine::rss_bytes().unwrap_or(0));
        if !o.json {
            let piece = match &tokenizer {
                Some(tok) => stream.push(tok, t.id)?,
                None => format!("{} ", t.id),
            };
            let _ = out.write_all(piece.as_bytes());
            let _ = out.flush();
        }
    }
    if let (false, Some(tok)) = (o.json, &tokenizer) {
        // A character the last tokens left incomplete.
        let _ = out.write_all(stream.finish(tok)?.as_bytes());
        let _ = out.flush();
    }
    let generated = gen.tokens().to_vec();
    let prefill_tok_s = prompt_ids.len() as f64 / prefill_s.max(1e-9);
    let decode_tok_s = decode_steps as f64 / decode_s.max(1e-9);
    let rss_max = nibble_core::io::machine::peak_rss_bytes().unwrap_or(0);
    if let Some(path) = &o.llm.logits_out {
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
        crate::output::print_profile(&dec.executor().profile());
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
            "budget": budget_note.json(),
            "bytes_source_per_step": source_per_step,
            "bytes_host_per_step": host_per_step,
            "bytes_read_totals": {
                "source": dec.executor().tier_totals().0,
                "host_tier": dec.executor().tier_totals().1,
            },
            "host_tier_memory": dec.executor().host_tier_memory(),
            "plan": dec.executor().plan().to_json(),
        });
        crate::output::write_stdout(&format!("{v}\n"))?;
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
        if let Some(m) = dec.executor().host_tier_memory() {
            eprintln!("host tier in {m}");
        }
    }
    Ok(())
}
