//! The API server's shared state and what every endpoint does with a request before its own
//! work: the body read under its size limit and deadline, parsed as one JSON value, the model
//! name checked, prompts tokenized.

// Helpers return the error response itself (`Result<T, Response>`): it is built once, on the
// error path only.
#![allow(clippy::result_large_err)]

use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::Response;
use nibble_core::models::text::TextTokenizer;
use serde_json::Value;

use super::engine::{Job, Shared};
use super::metrics::Metrics;
use super::reply::{bad, error, error_with};
use super::request::Prompt;

/// What the handlers hand the model thread.
pub(super) enum Work {
    Generate(std::sync::mpsc::Sender<Job>),
    Embed(std::sync::mpsc::Sender<EmbedJob>),
}

/// The server's state.
pub(super) struct App {
    pub(super) model_id: String,
    /// The LoRA adapters bound at start (`--lora NAME=PATH`), selected per request as
    /// `"model": "<model_id>:<NAME>"`.
    pub(super) adapters: Vec<String>,
    pub(super) work: Work,
    pub(super) tok: Arc<TextTokenizer>,
    /// Tokens a sequence may hold (decoder), or the longest input (encoder).
    pub(super) context: usize,
    /// Token ids the model embeds.
    pub(super) vocab: usize,
    /// Values in an embedding (an encoder's hidden width; 0 for a decoder).
    pub(super) dims: usize,
    pub(super) shared: Arc<Shared>,
    pub(super) metrics: Metrics,
    pub(super) plan: Value,
    pub(super) api_key: Option<String>,
    pub(super) max_body: usize,
    pub(super) body_timeout: std::time::Duration,
    pub(super) next_id: std::sync::atomic::AtomicU64,
}

/// Inputs to embed, and where their vectors go.
pub(super) struct EmbedJob {
    pub(super) inputs: Vec<Vec<u32>>,
    pub(super) reply: tokio::sync::oneshot::Sender<Result<Vec<Vec<f32>>, String>>,
}

/// The body, at most `--max-body` bytes (else 413).
async fn body(app: &App, headers: &HeaderMap, body: Body) -> Result<Bytes, Response> {
    let too_large = || {
        error(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            format!("the request body is over {} bytes", app.max_body),
        )
    };
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > app.max_body as u64) {
        return Err(too_large());
    }
    let read = tokio::time::timeout(app.body_timeout, axum::body::to_bytes(body, app.max_body));
    let Ok(read) = read.await else {
        return Err(error(
            StatusCode::REQUEST_TIMEOUT,
            "invalid_request_error",
            format!(
                "the request body was not sent within {} s (--body-timeout)",
                app.body_timeout.as_secs()
            ),
        ));
    };
    read.map_err(|e| {
        let length = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if length {
            too_large()
        } else {
            bad(format!("reading the request body: {e}"))
        }
    })
}

/// The body (at most `--max-body` bytes) as `T`, or the error response.
pub(super) async fn read<T: serde::de::DeserializeOwned>(
    app: &App,
    headers: &HeaderMap,
    b: Body,
) -> Result<T, Response> {
    parse(&body(app, headers, b).await?)
}

/// The request as `T`, or a 400 naming what is wrong (path and reason).
pub(super) fn parse<T: serde::de::DeserializeOwned>(b: &[u8]) -> Result<T, Response> {
    let mut de = serde_json::Deserializer::from_slice(b);
    let v = serde_path_to_error::deserialize(&mut de).map_err(|e| {
        bad(format!(
            "the request body is not valid: {} at '{}'",
            e.inner(),
            e.path()
        ))
    })?;
    // One JSON value and nothing after it but white space.
    de.end().map_err(|e| {
        bad(format!(
            "the request body has more after its JSON object: {e}"
        ))
    })?;
    Ok(v)
}

/// The adapter a request's `model` selects: `None` for the model itself (or no `model`),
/// `Some(i)` for `"<model_id>:<adapter name>"`; 404 for anything else.
pub(super) fn check_model(app: &App, model: &Option<String>) -> Result<Option<usize>, Response> {
    let Some(m) = model else {
        return Ok(None);
    };
    if *m == app.model_id {
        return Ok(None);
    }
    let named = m
        .strip_prefix(app.model_id.as_str())
        .and_then(|r| r.strip_prefix(':'))
        .and_then(|n| app.adapters.iter().position(|a| a == n));
    named.map(Some).ok_or_else(|| {
        let ids: Vec<String> = std::iter::once(app.model_id.clone())
            .chain(app.adapters.iter().map(|a| format!("{}:{a}", app.model_id)))
            .collect();
        error_with(
            StatusCode::NOT_FOUND,
            "invalid_request_error",
            Some("model_not_found"),
            format!(
                "the model '{m}' does not exist: this server serves {}",
                ids.iter()
                    .map(|i| format!("'{i}'"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        )
    })
}

/// The token ids of a prompt that is one text or one list of ids.
pub(super) fn one_prompt(app: &App, p: Prompt, special: bool) -> Result<Vec<u32>, Response> {
    let mut all = prompts(app, p, special)?;
    if all.len() != 1 {
        return Err(bad("prompt: one prompt per request"));
    }
    Ok(all.remove(0))
}

pub(super) fn prompts(app: &App, p: Prompt, special: bool) -> Result<Vec<Vec<u32>>, Response> {
    let enc = |t: &str| app.tok.encode(t, special).map_err(|e| bad(e.to_string()));
    Ok(match p {
        Prompt::Text(t) => vec![enc(&t)?],
        Prompt::Ids(ids) => vec![ids],
        Prompt::Texts(ts) => ts.iter().map(|t| enc(t)).collect::<Result<_, _>>()?,
        Prompt::IdLists(l) => l,
    })
}
