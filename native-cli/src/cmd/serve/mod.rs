//! `nibble serve`: two modes on one HTTP server (hyper and axum on tokio).
//! - `nibble serve DIR` serves a folder of files with byte ranges for HTTP streaming and the
//!   browser demo ([`files`]).
//! - `nibble serve --model PATH_OR_URL` opens and plans a model once and serves it over an
//!   OpenAI-compatible API ([`api`]): a decoder's concurrent requests are decoded together, one
//!   token of every active sequence per pass over the weights ([`engine`]); an encoder serves
//!   embeddings.
//!
//! Both modes share the connection handling ([`conn`]): header-read and idle timeouts and a cap
//! on open connections.

mod api;
mod app;
mod conn;
mod embed;
mod engine;
mod files;
mod metrics;
mod reply;
mod request;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::Router;
use clap::Args;

use crate::args::{BackendArg, FileModeArg, MemoryArgs};

pub use files::parse_mount;

/// Options of `nibble serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// The folder to serve; nothing outside it is reachable (without --model).
    #[arg(required_unless_present = "model", conflicts_with = "model")]
    pub dir: Option<PathBuf>,
    /// Serve this model (folder, `.safetensors` file, or http(s) URL of either) over an
    /// OpenAI-compatible API instead of a folder of files.
    #[arg(long)]
    pub model: Option<String>,
    /// Address to listen on (loopback unless told otherwise; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub addr: String,
    /// Also serve DIR at /NAME/ (repeatable), e.g. `--mount models=models` beside the browser
    /// demo's page.
    #[arg(long = "mount", value_name = "NAME=DIR", value_parser = parse_mount)]
    pub mounts: Vec<(String, PathBuf)>,
    /// Seconds a client may take to send a request's headers before the connection is closed.
    #[arg(long, value_name = "SECS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub header_timeout: u64,
    /// Seconds a client may take to send a request's body, once its headers are in (with
    /// --model; larger bodies than --max-body are refused at once).
    #[arg(long, value_name = "SECS", default_value_t = 30,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub body_timeout: u64,
    /// Seconds a connection may go without a byte read or written before it is closed (with
    /// --model, not while its response is being computed or streamed).
    #[arg(long, value_name = "SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub idle_timeout: u64,
    /// Connections served at once (more wait in the listen queue); capped by the open-file
    /// limit, less 32 descriptors for the files being served.
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_connections: u64,
    #[command(flatten)]
    pub api: ApiArgs,
}

/// An API key a client can send in `Authorization: Bearer KEY`: not empty, no spaces or
/// control characters.
fn api_key(s: &str) -> Result<String, String> {
    // What a header value can carry and the server compares: visible ASCII (a key with other
    // characters could never be matched).
    if s.is_empty() || !s.bytes().all(|b| b.is_ascii_graphic()) {
        return Err(format!(
            "{s:?}: an API key is one or more visible ASCII characters, no spaces (clients send \
             it as 'Authorization: Bearer KEY')"
        ));
    }
    Ok(s.to_string())
}

/// Options of the API server (`--model`).
#[derive(Debug, Clone, Args)]
#[command(next_help_heading = "API server (--model)")]
pub struct ApiArgs {
    /// Require `Authorization: Bearer KEY` on every /v1 request (a key of visible ASCII
    /// characters: an empty one, or one with others, could never be sent or matched).
    #[arg(long, value_name = "KEY", value_parser = api_key)]
    pub api_key: Option<String>,
    /// The model's id in the API (default: the model folder's or file's name).
    #[arg(long, value_name = "ID")]
    pub model_id: Option<String>,
    /// Sequences decoded together (each has a KV cache of --max-context tokens in the plan).
    #[arg(long, value_name = "N", default_value_t = 8,
          value_parser = clap::value_parser!(u64).range(1..=64))]
    pub max_batch: u64,
    /// Tokens a sequence may hold: prompt + completion (an encoder's longest input).
    #[arg(long, value_name = "T", default_value_t = 1024,
          value_parser = clap::value_parser!(u64).range(2..=1 << 20))]
    pub max_context: u64,
    /// Requests that may wait for a free sequence slot; past them, 503 with Retry-After.
    #[arg(long, value_name = "N", default_value_t = 64,
          value_parser = clap::value_parser!(u64).range(0..=1 << 20))]
    pub queue: u64,
    /// Prompt tokens one prefill pass of a lone prompt takes (ceil(len / N) passes); beside
    /// other sequences a prompt feeds N / 4 tokens (at least 2) to each mixed pass.
    #[arg(long, value_name = "N", default_value_t = 16,
          value_parser = clap::value_parser!(u64).range(1..=4096))]
    pub prefill_chunk: u64,
    /// Largest request body in bytes, 1 KiB to 1 GiB (larger: 413).
    #[arg(long, value_name = "SIZE", value_parser = crate::args::body_size, default_value = "4MiB")]
    pub max_body: u64,
    /// Backend that runs the ops.
    #[arg(long, value_enum, default_value_t)]
    pub backend: BackendArg,
    #[command(flatten)]
    pub memory: MemoryArgs,
    /// How local model files are read.
    #[arg(long, value_enum, default_value_t)]
    pub file_mode: FileModeArg,
    /// Time every op and print the slowest op kinds when the server stops.
    #[arg(long)]
    pub profile: bool,
    /// LoRA adapters (`--lora NAME=PATH[:SCALE]`), each selected per request by
    /// `"model": "<model id>:<NAME>"`; sequences with different adapters, or none, are decoded
    /// in the same passes over the base weights.
    #[command(flatten)]
    pub lora: crate::args::LoraArgs,
}

/// Serves a folder (DIR) or a model (--model) until interrupted.
pub fn run(a: &ServeArgs) -> Result<()> {
    let addr: SocketAddr = a
        .addr
        .parse()
        .with_context(|| format!("--addr '{}': expected IP:PORT", a.addr))?;
    match (&a.dir, &a.model) {
        (Some(dir), None) => files::run(a, dir, addr),
        (None, Some(model)) => {
            if !a.mounts.is_empty() {
                bail!("--mount serves folders beside DIR; with --model there is no folder");
            }
            api::run(a, model, addr)
        }
        _ => bail!("give a folder to serve or --model, not both"),
    }
}

/// Binds `addr` and serves `app` until Ctrl-C, after `announce` prints what is served where
/// (given the bound address: port 0 picks one).
pub(crate) async fn serve_until_interrupted(
    a: &ServeArgs,
    addr: SocketAddr,
    app: Router,
    announce: impl FnOnce(SocketAddr) -> Vec<String>,
) -> Result<()> {
    // A completion may take longer than the idle timeout before its first byte.
    let busy_is_not_idle = a.model.is_some();
    let listener = tokio::net::TcpListener::bind(addr)
        .await
        .with_context(|| format!("binding {addr}"))?;
    let local = listener.local_addr()?;
    let cap = conn::connection_cap(a.max_connections);
    // Nobody may be reading our output any more (a test that took the address): a closed pipe
    // must not stop the server.
    use std::io::Write;
    let mut out = std::io::stdout();
    for line in announce(local) {
        let _ = writeln!(out, "{line}");
    }
    let _ = writeln!(
        out,
        "{cap} connections at once, {} s to send headers, closed after {} s idle",
        a.header_timeout, a.idle_timeout
    );
    let _ = out.flush();
    tokio::select! {
        _ = conn::serve_connections(
            listener,
            app,
            cap,
            Duration::from_secs(a.header_timeout),
            Duration::from_secs(a.idle_timeout),
            busy_is_not_idle,
        ) => Ok(()),
        _ = tokio::signal::ctrl_c() => Ok(()),
        _ = terminated() => Ok(()),
    }
}

/// SIGTERM (how services and test harnesses stop a server): return, so that `main` cleans up.
async fn terminated() {
    #[cfg(unix)]
    if let Ok(mut s) = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        s.recv().await;
        return;
    }
    std::future::pending::<()>().await
}

/// The server's tokio runtime.
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the server runtime")
}
