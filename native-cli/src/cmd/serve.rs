//! `nibble serve DIR`: a static file server for models and the browser demo. Byte ranges
//! (single range, RFC 9110: 206, 416, `Accept-Ranges`), `Last-Modified` and the file body come
//! from tower-http's `ServeDir`; this adds a strong `ETag` from size and modification time, CORS
//! headers (exposing `Content-Range` and `ETag`) so that a page on another origin can stream, and
//! a guard that refuses every path that resolves outside DIR (`..`, `%2e%2e`, absolute paths,
//! symlinks pointing out) with 403.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
use clap::Args;
use tower_http::cors::{Any, CorsLayer};
use tower_http::services::ServeDir;

struct Root {
    canonical: PathBuf,
}

/// Maps a request path to a file under the root, or `None` if it would leave the root.
fn resolve(root: &Root, uri_path: &str) -> Option<PathBuf> {
    let decoded = percent_encoding::percent_decode_str(uri_path)
        .decode_utf8()
        .ok()?;
    let mut p = root.canonical.clone();
    for part in decoded.split('/') {
        match part {
            "" | "." => {}
            ".." => return None,
            s if s.contains('\\') || s.contains('\0') => return None,
            s => p.push(s),
        }
    }
    // Symlinks: whatever exists must canonicalize to a place inside the root.
    match p.canonicalize() {
        Ok(c) if c.starts_with(&root.canonical) => Some(c),
        Ok(_) => None,
        Err(_) => Some(p),
    }
}

async fn guard(State(root): State<Arc<Root>>, req: Request, next: Next) -> Response {
    let Some(file) = resolve(&root, req.uri().path()) else {
        return (StatusCode::FORBIDDEN, "outside the served folder\n").into_response();
    };
    let is_get = matches!(*req.method(), Method::GET | Method::HEAD);
    let mut resp = next.run(req).await;
    if is_get && resp.status().is_success() {
        if let Ok(meta) = std::fs::metadata(&file) {
            let mtime = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
                .map(|d| d.as_nanos())
                .unwrap_or(0);
            let etag = format!("\"{:x}-{:x}\"", meta.len(), mtime);
            if let Ok(v) = HeaderValue::from_str(&etag) {
                resp.headers_mut().insert(header::ETAG, v);
            }
        }
    }
    resp
}

/// One folder behind the path guard.
fn folder(dir: &Path) -> Result<Router> {
    let canonical = dir
        .canonicalize()
        .with_context(|| format!("{}: cannot serve it", dir.display()))?;
    anyhow::ensure!(canonical.is_dir(), "{}: not a folder", dir.display());
    let root = Arc::new(Root {
        canonical: canonical.clone(),
    });
    Ok(Router::new()
        .fallback_service(ServeDir::new(&canonical).append_index_html_on_directories(true))
        .layer(middleware::from_fn_with_state(root, guard)))
}

/// Parses `--mount NAME=DIR`.
pub fn parse_mount(s: &str) -> Result<(String, PathBuf)> {
    let (name, dir) = s
        .split_once('=')
        .with_context(|| format!("--mount '{s}': expected NAME=DIR"))?;
    let name = name.trim_matches('/');
    anyhow::ensure!(
        !name.is_empty()
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
            && name != "..",
        "--mount '{s}': NAME must be one path segment of letters, digits, '-', '_' or '.'"
    );
    Ok((name.to_string(), PathBuf::from(dir)))
}

/// The router: `dir` at `/`, each mount at `/NAME/` (exposed for tests through the binary).
fn app(dir: &Path, mounts: &[(String, PathBuf)]) -> Result<Router> {
    let cors = CorsLayer::new()
        .allow_origin(Any)
        .allow_methods([Method::GET, Method::HEAD, Method::OPTIONS])
        .allow_headers([
            header::RANGE,
            header::IF_RANGE,
            header::IF_NONE_MATCH,
            header::IF_MODIFIED_SINCE,
        ])
        .expose_headers([
            header::CONTENT_RANGE,
            header::CONTENT_LENGTH,
            header::ACCEPT_RANGES,
            header::ETAG,
            header::LAST_MODIFIED,
        ]);
    let mut router = Router::new();
    for (name, path) in mounts {
        router = router.nest_service(&format!("/{name}"), folder(path)?);
    }
    Ok(router.fallback_service(folder(dir)?).layer(cors))
}

/// Serves `dir` on `addr` until interrupted.
/// Options of `nibble serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// The folder to serve; nothing outside it is reachable.
    pub dir: PathBuf,
    /// Address to listen on (loopback unless told otherwise; port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub addr: String,
    /// Also serve DIR at /NAME/ (repeatable), e.g. `--mount models=models` beside the browser
    /// demo's page.
    #[arg(long = "mount", value_name = "NAME=DIR", value_parser = parse_mount)]
    pub mounts: Vec<(String, PathBuf)>,
}

/// Serves the folder until interrupted.
pub fn run(a: &ServeArgs) -> Result<()> {
    let (dir, mounts, addr) = (a.dir.as_path(), a.mounts.as_slice(), a.addr.as_str());
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("--addr '{addr}': expected IP:PORT"))?;
    let app = app(dir, mounts)?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("starting the server runtime")?;
    rt.block_on(async move {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        // Nobody may be reading our output any more (a test that took the address): a closed
        // pipe must not stop the server.
        use std::io::Write;
        let mut out = std::io::stdout();
        let _ = writeln!(
            out,
            "serving {} at http://{local}/ (Ctrl-C to stop)",
            dir.display()
        );
        for (name, path) in mounts {
            let _ = writeln!(out, "serving {} at http://{local}/{name}/", path.display());
        }
        let _ = out.flush();
        axum::serve(listener, app.into_make_service())
            .with_graceful_shutdown(async {
                let _ = tokio::signal::ctrl_c().await;
            })
            .await
            .context("server error")
    })
}
