//! `POST /v1/embeddings` and the encoder's loop on the model thread. A request takes a place
//! through the same admission as completions (`--max-batch` running, `--queue` waiting, else 503),
//! holds at most [`MAX_INPUTS`] inputs, and is dropped between inputs when its client leaves.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use nibble_core::backend::Backend;
use nibble_core::models::bert::{Encoder, Pooling};
use serde_json::{json, Value};

use super::app::{check_model, prompts, read, App, EmbedJob, Work};
use super::engine::Shared;
use super::reply::{bad, error, ok_json, unavailable};
use super::request::EmbeddingRequest;

/// Inputs one request may hold (OpenAI's limit).
pub(super) const MAX_INPUTS: usize = 2048;

/// The model thread: embeds each job's inputs until the server drops the channel. A job whose
/// client has gone (its reply channel closed) stops at the next input.
pub(super) fn serve_jobs<B: Backend>(
    enc: &mut Encoder<B>,
    pooling: &Pooling,
    jobs: &std::sync::mpsc::Receiver<EmbedJob>,
    shared: &Shared,
) {
    while let Ok(job) = jobs.recv() {
        let mut out = Vec::with_capacity(job.inputs.len());
        let mut failed = None;
        for ids in &job.inputs {
            if job.reply.is_closed() {
                shared
                    .counters
                    .cancelled
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                break;
            }
            let t0 = Instant::now();
            match enc.embed(ids, pooling) {
                Ok((v, stats)) => {
                    shared.counters.pass(
                        t0.elapsed().as_secs_f64(),
                        stats.source_bytes,
                        stats.host_bytes,
                    );
                    out.push(v);
                }
                Err(e) => {
                    failed = Some(e.to_string());
                    break;
                }
            }
        }
        let _ = job.reply.send(match failed {
            Some(e) => Err(e),
            None => Ok(out),
        });
    }
}

/// A place taken through [`Shared::admit`], given back when the request ends however it ends
/// (answered, refused, or dropped when its client left).
struct Place<'a>(&'a Shared);

impl Drop for Place<'_> {
    fn drop(&mut self) {
        self.0.release();
    }
}

pub(super) async fn embeddings(
    State(app): State<Arc<App>>,
    headers: HeaderMap,
    b: Body,
) -> Response {
    let r: EmbeddingRequest = match read(&app, &headers, b).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Err(r) = check_model(&app, &r.model) {
        return r;
    }
    let Work::Embed(jobs) = &app.work else {
        return bad(format!(
            "'{}' is a decoder: /v1/embeddings needs an encoder model",
            app.model_id
        ));
    };
    let base64 = match r.encoding_format.as_deref() {
        None | Some("float") => false,
        Some("base64") => true,
        Some(f) => return bad(format!("encoding_format '{f}': float or base64")),
    };
    if let Some(d) = r.dimensions.filter(|&d| d != app.dims as u64) {
        return bad(format!(
            "dimensions: {d} was asked, but this model's embeddings have {} values and nibble \
             does not shorten them",
            app.dims
        ));
    }
    // Counted, then admitted, before a single input is tokenized: neither a request of many
    // inputs nor many requests make work beyond the cap and the queue.
    if r.input.count() > MAX_INPUTS {
        return bad(format!(
            "input: {} inputs in one request; at most {MAX_INPUTS}",
            r.input.count()
        ));
    }
    if !app.shared.admit() {
        return unavailable();
    }
    let _place = Place(&app.shared);
    let inputs = match prompts(&app, r.input, true) {
        Ok(i) => i,
        Err(r) => return r,
    };
    if inputs.is_empty() || inputs.iter().any(Vec::is_empty) {
        return bad("input: every input needs at least one token");
    }
    let vocab = app.vocab;
    for ids in &inputs {
        if ids.len() > app.context {
            return bad(format!(
                "an input of {} tokens: this model takes at most {}",
                ids.len(),
                app.context
            ));
        }
        if let Some(t) = ids.iter().find(|&&t| t as usize >= vocab) {
            return bad(format!("token id {t} is outside the vocabulary of {vocab}"));
        }
    }
    let tokens: usize = inputs.iter().map(Vec::len).sum();
    let (tx, rx) = tokio::sync::oneshot::channel();
    if jobs.send(EmbedJob { inputs, reply: tx }).is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the model thread has stopped",
        );
    }
    // When the client leaves, this future is dropped with `rx`: the model thread sees the
    // channel closed and stops the job.
    let vectors = match rx.await {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e),
        Err(_) => {
            return error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                "no answer from the model thread",
            )
        }
    };
    app.shared
        .counters
        .prompt_tokens
        .fetch_add(tokens as u64, std::sync::atomic::Ordering::Relaxed);
    let data: Vec<Value> = vectors
        .into_iter()
        .enumerate()
        .map(|(i, v)| {
            let e = if base64 {
                use base64::Engine as _;
                let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                json!(base64::engine::general_purpose::STANDARD.encode(bytes))
            } else {
                json!(v)
            };
            json!({"object": "embedding", "index": i, "embedding": e})
        })
        .collect();
    ok_json(
        json!({"object": "list", "data": data, "model": app.model_id,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}),
    )
    .into_response()
}
