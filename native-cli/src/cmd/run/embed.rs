//! `nibble run` on a BERT encoder: the sentence embedding of the prompt, pooled and normalized
//! as the model's sentence-transformers files say (mean pooling, no normalization without them).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use nibble_core::backend::Backend;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::bert::{self, Encoder, Pooling, PoolingMode};
use nibble_core::models::text::TextTokenizer;
use nibble_core::plan::fmt_bytes;
use serde_json::json;

use super::options::RunArgs;

/// Embeds `o.prompt` (or `o.text.prompt_ids`) and prints the vector.
pub(super) fn run<B: Backend>(
    o: &RunArgs,
    model: &ModelIndex,
    mut backend: B,
    label: &str,
) -> Result<()> {
    let cfg = bert::BertConfig::of(model)?;
    let limit = nibble_core::io::folder::block_on(bert::max_seq_len(model, &cfg))?;
    let ids: Vec<u32> = match &o.text.prompt {
        Some(text) => {
            if o.text.chat {
                bail!("--chat: an encoder has no chat template");
            }
            let mut tok = TextTokenizer::for_model(model)?;
            tok.set_max_len(Some(limit))?;
            tok.encode(text, true)?
        }
        None => o.text.prompt_ids.clone(),
    };
    if ids.is_empty() {
        bail!("the prompt has no tokens");
    }
    if ids.len() > limit {
        bail!(
            "{} prompt ids: the model takes at most {limit} tokens",
            ids.len()
        );
    }
    let pooling = Pooling::for_model(model)?;
    let bg = bert::build(model, ids.len())?;
    let Some((opts, budget_note)) =
        super::plan::prelude(o, &mut backend, label, "encoder", &bg.graph, model)?
    else {
        return Ok(());
    };
    let t_setup = Instant::now();
    let mut enc = Encoder::from_graph(bg, model, backend, opts)
        .with_context(|| format!("planning {} on {label}", o.model))?;
    super::plan::announce(o, label, &budget_note, enc.executor().plan());
    if !o.json {
        eprintln!(
            "{} tokens; setup {:.0} ms",
            ids.len(),
            t_setup.elapsed().as_secs_f64() * 1e3
        );
    }
    let t = Instant::now();
    let (embedding, stats) = enc.embed(&ids, &pooling)?;
    let wall = t.elapsed().as_secs_f64();
    let rss_max = nibble_core::io::machine::peak_rss_bytes().unwrap_or(0);
    let mode = match pooling.mode {
        PoolingMode::Mean => "mean",
        PoolingMode::Cls => "cls",
        PoolingMode::Max => "max",
        PoolingMode::MeanSqrtLen => "mean_sqrt_len",
    };
    if o.json {
        let v = json!({
            "tokens": ids,
            "embedding": embedding,
            "pooling": mode,
            "normalized": pooling.normalize,
            "tok_s": ids.len() as f64 / wall,
            "rss_max_bytes": rss_max,
            "bytes_streamed": stats.stream.bytes,
            "bytes_in_place": stats.in_place_bytes,
            "budget": budget_note.json(),
            // One pass: the arrays have one entry, as a one-step run's.
            "bytes_source_per_step": [stats.source_bytes],
            "bytes_host_per_step": [stats.host_bytes],
            "plan": enc.executor().plan().to_json(),
        });
        crate::output::write_stdout(&format!("{v}\n"))?;
    } else {
        let values: Vec<String> = embedding.iter().map(|x| format!("{x}")).collect();
        crate::output::write_stdout(&format!("[{}]\n", values.join(", ")))?;
        eprintln!(
            "embedding: {} values ({mode} pooling{}) of {} tokens in {:.1} ms; peak RSS {}; streamed {}",
            embedding.len(),
            if pooling.normalize { ", L2-normalized" } else { "" },
            ids.len(),
            wall * 1e3,
            fmt_bytes(rss_max),
            fmt_bytes(stats.stream.bytes)
        );
    }
    Ok(())
}
