//! `nibble serve --model`: an OpenAI-compatible API over one model, opened and planned once.
//!
//! Endpoints: `GET /health`, `GET /metrics` (Prometheus text), `GET /v1/models`, `GET /v1/plan`
//! (the memory plan printed at start); for a decoder `POST /v1/chat/completions` (through the
//! model's chat template) and `POST /v1/completions` (a prompt string or token ids), both with
//! `stream` as server-sent events ending in `data: [DONE]`; for an encoder `POST
//! /v1/embeddings`. Errors are OpenAI error objects: 400 for a request nibble cannot take (bad
//! JSON, a field of the wrong type, a prompt or `max_tokens` beyond the context), 401 for a
//! missing or wrong API key, 404 for an unknown model or path, 413 for a body over `--max-body`,
//! 503 with `Retry-After` when every sequence slot and queue place is taken.
//!
//! The model runs on the thread that called [`run`] (the decoding [`Engine`], or the encoder's
//! loop); the HTTP server runs on a tokio runtime beside it and talks to it through channels.

// Handlers' helpers return the error response itself (`Result<T, Response>`): it is built once,
// on the error path only.
#![allow(clippy::result_large_err)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use anyhow::{bail, Context, Result};
use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use nibble_core::backend::Backend;
use nibble_core::io::model::ModelIndex;
use nibble_core::models::bert::{self, Encoder, Pooling};
use nibble_core::models::llama::{self, BatchDecoder, BatchShape, Sampling};
use nibble_core::models::text::{Message, TextTokenizer};
use nibble_core::models::ModelKind;
use serde_json::{json, Value};
use tokio::sync::mpsc::unbounded_channel;

use super::app::{check_model, one_prompt, read, App, EmbedJob, Work};
use super::engine::{Client, Engine, Event, Job, Shared};
use super::metrics::Metrics;
use super::reply::{bad, error, error_with, ok_json, unavailable};
use super::request::{ChatRequest, Common, CompletionRequest, Content, OneOrMany};
use super::ServeArgs;
use crate::cmd::run::exec_options;

/// Serves `model` until interrupted.
pub(super) fn run(a: &ServeArgs, model: &str, addr: SocketAddr) -> Result<()> {
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_target(false)
        .try_init();
    let api = &a.api;
    let index = ModelIndex::open_path_or_url(model, api.file_mode.into())?;
    let Some(kind) = index.config.as_ref().and_then(ModelKind::of_config) else {
        bail!("{model}: config.json is neither a Llama-family decoder nor a BERT encoder");
    };
    if kind == ModelKind::Dit {
        bail!("{model}: a DiT has no OpenAI API here (nibble serves decoders and encoders)");
    }
    if kind == ModelKind::Encoder && !api.lora.lora.is_empty() {
        bail!("{model}: --lora is for language models (an encoder serves no adapters)");
    }
    let index = api.lora.bind(
        &index,
        nibble_core::models::lora::Target::model(),
        api.file_mode.into(),
        false,
    )?;
    let model_id = api.model_id.clone().unwrap_or_else(|| {
        model
            .trim_end_matches('/')
            .rsplit('/')
            .next()
            .unwrap_or(model)
            .to_string()
    });
    crate::backends::select(api.backend)?.run(Serve {
        a,
        model: &index,
        kind,
        model_id,
        addr,
    })
}

struct Serve<'a> {
    a: &'a ServeArgs,
    model: &'a ModelIndex,
    kind: ModelKind,
    model_id: String,
    addr: SocketAddr,
}

impl crate::backends::WithBackend for Serve<'_> {
    type Output = ();
    fn call<B: Backend + 'static>(self, mut backend: B, label: &str) -> Result<()> {
        let api = &self.a.api;
        let shared = Arc::new(Shared::new(api.max_batch, api.queue));
        let mut tok = TextTokenizer::for_model(self.model)?;
        match self.kind {
            ModelKind::Llm => {
                let cfg = llama::LlamaConfig::of(self.model)?;
                let context = (api.max_context as usize).min(cfg.max_positions);
                let shape = BatchShape {
                    slots: api.max_batch as usize,
                    context,
                    chunk: (api.prefill_chunk as usize).min(context),
                    // A quarter of a chunk per sequence in a mixed pass (none below 2).
                    mix: (api.prefill_chunk as usize / 4)
                        .max(2)
                        .min(api.prefill_chunk as usize)
                        .min(context),
                };
                let bg = llama::build_batched(self.model, shape)?;
                let (opts, note) =
                    exec_options(&self.a.api.memory, &mut backend, &[(&bg.graph, self.model)])?;
                let t0 = Instant::now();
                let mut dec = BatchDecoder::new(bg, self.model, backend, opts)
                    .with_context(|| format!("planning {} on {label}", self.model_id))?;
                let plan = dec.executor().plan();
                eprintln!("backend {label}");
                eprintln!("{}", note.note);
                eprint!("{}", plan.explain());
                eprintln!(
                    "{} sequences of up to {context} tokens decoded together, prompts in chunks \
                     of {}; setup {:.0} ms",
                    shape.slots,
                    shape.chunk,
                    t0.elapsed().as_secs_f64() * 1e3
                );
                let plan = json!({
                    "budget": note.json(),
                    "plan": plan.to_json(),
                    "max_batch": shape.slots,
                    "max_context": context,
                    "prefill_chunk": shape.chunk,
                    "backend": label,
                });
                let eos = nibble_core::io::folder::block_on(llama::eos_ids(self.model, &cfg))?;
                let (jobs, rx) = std::sync::mpsc::channel();
                let tok = Arc::new(tok);
                let app = self.app(
                    Work::Generate(jobs),
                    tok.clone(),
                    (context, cfg.vocab, 0),
                    &shared,
                    plan,
                );
                let server = spawn_server(self.a, self.addr, app)?;
                dec.executor_mut().set_profile(api.profile);
                let dec = Engine::new(dec, tok, eos, rx, shared).run();
                if api.profile {
                    crate::output::print_profile(&dec.executor().profile());
                }
                join(server)
            }
            ModelKind::Encoder => {
                let cfg = bert::BertConfig::of(self.model)?;
                let limit = nibble_core::io::folder::block_on(bert::max_seq_len(self.model, &cfg))?;
                let context = limit.min(api.max_context as usize);
                tok.set_max_len(Some(context))?;
                let pooling = Pooling::for_model(self.model)?;
                let bg = bert::build(self.model, context)?;
                let (opts, note) =
                    exec_options(&self.a.api.memory, &mut backend, &[(&bg.graph, self.model)])?;
                let mut enc = Encoder::from_graph(bg, self.model, backend, opts)
                    .with_context(|| format!("planning {} on {label}", self.model_id))?;
                eprintln!("backend {label}");
                eprintln!("{}", note.note);
                eprint!("{}", enc.executor().plan().explain());
                let plan = json!({
                    "budget": note.json(),
                    "plan": enc.executor().plan().to_json(),
                    "max_context": context,
                    "backend": label,
                });
                let (jobs, rx) = std::sync::mpsc::channel::<EmbedJob>();
                let app = self.app(
                    Work::Embed(jobs),
                    Arc::new(tok),
                    (context, cfg.vocab, cfg.hidden),
                    &shared,
                    plan,
                );
                let server = spawn_server(self.a, self.addr, app)?;
                super::embed::serve_jobs(&mut enc, &pooling, &rx, &shared);
                join(server)
            }
            ModelKind::Dit => bail!("a DiT has no OpenAI API here"),
        }
    }
}

impl Serve<'_> {
    fn app(
        &self,
        work: Work,
        tok: Arc<TextTokenizer>,
        (context, vocab, dims): (usize, usize, usize),
        shared: &Arc<Shared>,
        plan: Value,
    ) -> App {
        App {
            model_id: self.model_id.clone(),
            adapters: self.model.adapters().names.clone(),
            work,
            tok,
            context,
            vocab,
            dims,
            shared: shared.clone(),
            metrics: Metrics::default(),
            plan,
            api_key: self.a.api.api_key.clone(),
            max_body: self.a.api.max_body.min(usize::MAX as u64) as usize,
            body_timeout: std::time::Duration::from_secs(self.a.body_timeout),
            next_id: Default::default(),
        }
    }
}

/// Starts the HTTP server on its own thread; it returns when interrupted, dropping the app and
/// with it the channels to the model thread, which then ends too.
fn spawn_server(
    a: &ServeArgs,
    addr: SocketAddr,
    app: App,
) -> Result<std::thread::JoinHandle<Result<()>>> {
    let a = a.clone();
    let rt = super::runtime()?;
    Ok(std::thread::Builder::new()
        .name("nibble-http".into())
        .spawn(move || {
            let id = app.model_id.clone();
            let router = router(Arc::new(app));
            rt.block_on(super::serve_until_interrupted(&a, addr, router, |local| {
                vec![format!(
                    "serving {id} at http://{local}/v1 (OpenAI API; Ctrl-C to stop)"
                )]
            }))
        })?)
}

fn join(h: std::thread::JoinHandle<Result<()>>) -> Result<()> {
    h.join()
        .map_err(|_| anyhow::anyhow!("the HTTP server thread panicked"))?
}

fn router(app: Arc<App>) -> Router {
    Router::new()
        .route(
            "/health",
            get(|| async { ok_json(json!({"status": "ok"})) }),
        )
        .route("/metrics", get(metrics))
        .route("/v1/models", get(models))
        .route("/v1/plan", get(plan))
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/embeddings", post(super::embed::embeddings))
        .fallback(|| async {
            error(
                StatusCode::NOT_FOUND,
                "invalid_request_error",
                "no such endpoint",
            )
        })
        .method_not_allowed_fallback(|| async {
            error(
                StatusCode::METHOD_NOT_ALLOWED,
                "invalid_request_error",
                "this endpoint does not take that method (GET /v1/models, /v1/plan; POST \
                 /v1/chat/completions, /v1/completions, /v1/embeddings)",
            )
        })
        .layer(middleware::from_fn_with_state(app.clone(), guard))
        .with_state(app)
}

/// The API key check and one log line per request (and its count in the metrics).
async fn guard(State(app): State<Arc<App>>, req: Request, next: Next) -> Response {
    let t0 = Instant::now();
    let (method, path) = (req.method().clone(), req.uri().path().to_string());
    let resp = match &app.api_key {
        Some(key) if path.starts_with("/v1") => {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            if given == Some(key.as_str()) {
                next.run(req).await
            } else {
                error_with(
                    StatusCode::UNAUTHORIZED,
                    "invalid_request_error",
                    Some("invalid_api_key"),
                    "a missing or wrong API key: send Authorization: Bearer KEY",
                )
            }
        }
        _ => next.run(req).await,
    };
    let status = resp.status().as_u16();
    let endpoint = match path.as_str() {
        "/health"
        | "/metrics"
        | "/v1/models"
        | "/v1/plan"
        | "/v1/chat/completions"
        | "/v1/completions"
        | "/v1/embeddings" => path.as_str(),
        _ => "other",
    };
    app.metrics.request(endpoint, status);
    tracing::info!(
        "{method} {path} {status} {:.1} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    resp
}

async fn metrics(State(app): State<Arc<App>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        app.metrics.render(&app.shared.counters),
    )
        .into_response()
}

async fn models(State(app): State<Arc<App>>) -> Response {
    let data: Vec<Value> = std::iter::once(app.model_id.clone())
        .chain(app.adapters.iter().map(|a| format!("{}:{a}", app.model_id)))
        .map(|id| model_object(&id))
        .collect();
    ok_json(json!({"object": "list", "data": data})).into_response()
}

fn model_object(id: &str) -> Value {
    json!({"id": id, "object": "model", "created": 0, "owned_by": "nibble"})
}

async fn plan(State(app): State<Arc<App>>) -> Response {
    ok_json(app.plan.clone()).into_response()
}

fn generator(app: &App) -> Result<&std::sync::mpsc::Sender<Job>, Response> {
    match &app.work {
        Work::Generate(s) => Ok(s),
        Work::Embed(_) => Err(bad(format!(
            "'{}' is an encoder: it serves /v1/embeddings, not completions",
            app.model_id
        ))),
    }
}

/// What the request asks to generate, checked against the context.
struct Ask {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: Sampling,
    stop: Vec<String>,
    stop_at_eos: bool,
    stream: bool,
    usage_in_stream: bool,
    /// The LoRA adapter the request's `model` selects.
    adapter: Option<usize>,
    /// The model id answered with (the request's, adapter included).
    model: String,
}

fn ask(app: &App, c: Common, prompt: Vec<u32>) -> Result<Ask, Response> {
    let adapter = check_model(app, &c.model)?;
    let model = match adapter {
        Some(a) => format!("{}:{}", app.model_id, app.adapters[a]),
        None => app.model_id.clone(),
    };
    if c.n.is_some_and(|n| n != 1) {
        return Err(bad("n: nibble generates one choice per request (n = 1)"));
    }
    if prompt.is_empty() {
        return Err(bad("the prompt has no tokens"));
    }
    let vocab_ok = app.vocab;
    if let Some(bad_id) = prompt.iter().find(|&&t| t as usize >= vocab_ok) {
        return Err(bad(format!(
            "token id {bad_id} is outside the vocabulary of {vocab_ok}"
        )));
    }
    let ctx = app.context;
    if prompt.len() >= ctx {
        return Err(bad(format!(
            "the prompt has {} tokens: this server's context holds {ctx} (prompt + completion, \
             --max-context), leaving no room to generate",
            prompt.len()
        )));
    }
    let room = ctx - prompt.len();
    let max_tokens = match c.max_completion_tokens.or(c.max_tokens) {
        Some(0) => return Err(bad("max_tokens must be at least 1")),
        Some(n) if n > room as u64 => {
            return Err(bad(format!(
                "max_tokens {n} + the prompt's {} tokens exceed this server's context of {ctx} \
                 tokens (at most {room})",
                prompt.len()
            )))
        }
        Some(n) => n as usize,
        None => room,
    };
    let temperature = c.temperature.unwrap_or(1.0);
    if !(0.0..=2.0).contains(&temperature) {
        return Err(bad(format!("temperature {temperature} is not in [0, 2]")));
    }
    let sampling = Sampling {
        temperature,
        top_k: 0,
        top_p: c.top_p.unwrap_or(1.0),
        seed: c.seed.unwrap_or_else(|| {
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        }),
    };
    sampling.check().map_err(|e| bad(e.to_string()))?;
    let stop = c.stop.map(OneOrMany::list).unwrap_or_default();
    if stop.len() > 4 || stop.iter().any(String::is_empty) {
        return Err(bad("stop: up to 4 non-empty strings"));
    }
    Ok(Ask {
        prompt,
        max_tokens,
        sampling,
        stop,
        stop_at_eos: !c.ignore_eos,
        stream: c.stream,
        usage_in_stream: c.stream_options.is_some_and(|o| o.include_usage),
        adapter,
        model,
    })
}

/// Which endpoint a generation answers.
#[derive(Clone, Copy, PartialEq)]
enum Shape {
    Chat,
    Text,
}

async fn chat(State(app): State<Arc<App>>, headers: HeaderMap, b: Body) -> Response {
    let r: ChatRequest = match read(&app, &headers, b).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Err(r) = generator(&app) {
        return r;
    }
    if r.messages.is_empty() {
        return bad("messages: at least one message");
    }
    let mut msgs = Vec::with_capacity(r.messages.len());
    for (i, m) in r.messages.iter().enumerate() {
        match message_text(m) {
            Ok(text) => msgs.push(Message::new(&m.role, &text)),
            Err(e) => return bad(format!("messages[{i}].{e}")),
        }
    }
    let prompt = match app
        .tok
        .apply_chat_template(&msgs, true)
        .and_then(|s| app.tok.encode(&s, false))
    {
        Ok(p) => p,
        Err(e) => return bad(e.to_string()),
    };
    match ask(&app, r.common, prompt) {
        Ok(a) => generate(app, a, Shape::Chat).await,
        Err(r) => r,
    }
}

/// A message's text: its string, or its parts, which must all be text (a model that reads text
/// only cannot answer about an image it was never shown).
fn message_text(m: &super::request::ChatMessage) -> Result<String, String> {
    match &m.content {
        None => Ok(String::new()),
        Some(Content::Text(t)) => Ok(t.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (j, p) in parts.iter().enumerate() {
                match (p.kind.as_str(), &p.text) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(format!("content[{j}]: a text part without text"))
                    }
                    (k, _) => {
                        return Err(format!(
                        "content[{j}]: '{k}' parts are not supported: this model reads text only"
                    ))
                    }
                }
            }
            Ok(text)
        }
    }
}

async fn completions(State(app): State<Arc<App>>, headers: HeaderMap, b: Body) -> Response {
    let r: CompletionRequest = match read(&app, &headers, b).await {
        Ok(r) => r,
        Err(r) => return r,
    };
    if let Err(r) = generator(&app) {
        return r;
    }
    let prompt = match one_prompt(&app, r.prompt, true) {
        Ok(p) => p,
        Err(r) => return r,
    };
    match ask(&app, r.common, prompt) {
        Ok(a) => generate(app, a, Shape::Text).await,
        Err(r) => r,
    }
}

/// Submits the generation and answers with the whole completion or a stream of events.
async fn generate(app: Arc<App>, a: Ask, shape: Shape) -> Response {
    let Ok(jobs) = generator(&app) else {
        return bad("not a decoder");
    };
    if !app.shared.admit() {
        return unavailable();
    }
    let (tx, mut rx) = unbounded_channel();
    let prompt_tokens = a.prompt.len();
    let job = Job {
        prompt: a.prompt,
        max_tokens: a.max_tokens,
        sampling: a.sampling,
        stop: a.stop,
        stop_at_eos: a.stop_at_eos,
        adapter: a.adapter,
        events: Box::new(Client(tx)),
    };
    if jobs.send(job).is_err() {
        return error(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            "the model thread has stopped",
        );
    }
    let n = app
        .next_id
        .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let id = match shape {
        Shape::Chat => format!("chatcmpl-{n}"),
        Shape::Text => format!("cmpl-{n}"),
    };
    let created = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let model = a.model.clone();
    if !a.stream {
        let mut text = String::new();
        loop {
            match rx.recv().await {
                Some(Event::Text(t)) => text.push_str(&t),
                Some(Event::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                }) => {
                    let usage = usage(prompt_tokens, completion_tokens);
                    let choice = match shape {
                        Shape::Chat => {
                            json!({"index": 0, "message": {"role": "assistant", "content": text},
                            "logprobs": null, "finish_reason": finish})
                        }
                        Shape::Text => json!({"index": 0, "text": text, "logprobs": null,
                            "finish_reason": finish}),
                    };
                    let object = match shape {
                        Shape::Chat => "chat.completion",
                        Shape::Text => "text_completion",
                    };
                    return ok_json(json!({"id": id, "object": object, "created": created,
                        "model": model, "choices": [choice], "usage": usage}))
                    .into_response();
                }
                Some(Event::Error(e)) => {
                    return error(StatusCode::INTERNAL_SERVER_ERROR, "server_error", e)
                }
                None => {
                    return error(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        "server_error",
                        "the model thread ended the request without an answer",
                    )
                }
            }
        }
    }
    let object = match shape {
        Shape::Chat => "chat.completion.chunk",
        Shape::Text => "text_completion",
    };
    let chunk = move |choices: Value, usage: Option<Value>| -> String {
        let mut v = json!({"id": id, "object": object, "created": created, "model": model,
            "choices": choices});
        if let Some(u) = usage {
            v["usage"] = u;
        }
        format!("data: {v}\n\n")
    };
    let delta = move |text: Option<&str>, finish: Option<&str>| -> Value {
        match shape {
            Shape::Chat => {
                let d = match text {
                    Some(t) => json!({"content": t}),
                    None => json!({}),
                };
                json!([{"index": 0, "delta": d, "logprobs": null, "finish_reason": finish}])
            }
            Shape::Text => json!([{"index": 0, "text": text.unwrap_or(""), "logprobs": null,
                "finish_reason": finish}]),
        }
    };
    let with_usage = a.usage_in_stream;
    // The first event (the assistant's role) goes out at once, so that a client sees the
    // response start while the prompt is prefilled.
    let first = match shape {
        Shape::Chat => Some(chunk(
            json!([{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null,
                "finish_reason": null}]),
            None,
        )),
        Shape::Text => None,
    };
    let state = (rx, false, first);
    let stream = futures_util::stream::unfold(state, move |(mut rx, done, first)| {
        let chunk = chunk.clone();
        async move {
            if let Some(f) = first {
                return Some((Ok::<_, std::convert::Infallible>(f), (rx, done, None)));
            }
            if done {
                return None;
            }
            let out = match rx.recv().await {
                Some(Event::Text(t)) => chunk(delta(Some(&t), None), None),
                Some(Event::Done {
                    finish,
                    completion_tokens,
                    ..
                }) => {
                    let mut s = chunk(delta(None, Some(finish)), None);
                    if with_usage {
                        s.push_str(&chunk(
                            json!([]),
                            Some(usage(prompt_tokens, completion_tokens)),
                        ));
                    }
                    s.push_str("data: [DONE]\n\n");
                    return Some((Ok(s), (rx, true, None)));
                }
                Some(Event::Error(e)) => {
                    let v = json!({"error": {"message": e, "type": "server_error", "param": null,
                        "code": null}});
                    return Some((
                        Ok(format!("data: {v}\n\ndata: [DONE]\n\n")),
                        (rx, true, None),
                    ));
                }
                None => return None,
            };
            Some((Ok(out), (rx, false, None)))
        }
    });
    Response::builder()
        .header(header::CONTENT_TYPE, "text/event-stream")
        .header(header::CACHE_CONTROL, "no-cache")
        .body(Body::from_stream(stream))
        .unwrap_or_else(|e| {
            error(
                StatusCode::INTERNAL_SERVER_ERROR,
                "server_error",
                e.to_string(),
            )
        })
}

fn usage(prompt: usize, completion: usize) -> Value {
    json!({"prompt_tokens": prompt, "completion_tokens": completion,
        "total_tokens": prompt + completion})
}
