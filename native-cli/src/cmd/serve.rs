//! `nibble serve DIR`: a static file server for models and the browser demo. Byte ranges
//! (single range, RFC 9110: 206, 416, `Accept-Ranges`), `Last-Modified` and the file body come
//! from tower-http's `ServeDir`; this adds a strong `ETag` from size and modification time,
//! `If-Range` (a validator that does not match gets the whole file, 200), CORS headers (exposing
//! `Content-Range` and `ETag`) so that a page on another origin can stream, and a guard that
//! refuses every path that resolves outside DIR (`..`, `%2e%2e`, absolute paths, symlinks
//! pointing out, a folder's `index.html` included) or to something that is not a regular file,
//! with 403. Repeated slashes are collapsed before routing, so no redirect is protocol-relative.
//!
//! Connections are served by hyper directly: a client gets `--header-timeout` seconds to send a
//! request's headers, a connection with no byte read or written for `--idle-timeout` seconds is
//! closed, and at most `--max-connections` (capped by the open-file limit) are served at once;
//! further ones wait in the listen queue.

use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

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

/// Maps a request path to the file it serves under the root (a folder's `index.html` for a
/// folder), or `None` if it would leave the root or is not a regular file or folder.
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
    // Symlinks: whatever exists must canonicalize to a place inside the root, and be a regular
    // file (a FIFO or a device would block or never end) or a folder, whose index file is
    // checked the same way since it is what gets served.
    let inside = |p: &Path| -> Option<Option<PathBuf>> {
        match p.canonicalize() {
            Ok(c) if !c.starts_with(&root.canonical) => None,
            Ok(c) => {
                let meta = std::fs::metadata(&c).ok()?;
                (meta.is_file() || meta.is_dir()).then_some(Some(c))
            }
            Err(_) => Some(None),
        }
    };
    match inside(&p)? {
        Some(c) if c.is_dir() => match inside(&c.join("index.html"))? {
            Some(index) => Some(index),
            None => Some(c),
        },
        Some(c) => Some(c),
        None => Some(p),
    }
}

/// The strong `ETag` of a file: its size and modification time.
fn etag(meta: &std::fs::Metadata) -> String {
    let mtime = meta
        .modified()
        .ok()
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("\"{:x}-{:x}\"", meta.len(), mtime)
}

/// Whether an `If-Range` value names this version of the file (RFC 9110 13.1.5: a strong ETag
/// equal to ours, or the exact `Last-Modified` date).
fn if_range_matches(value: &str, meta: &std::fs::Metadata) -> bool {
    let value = value.trim();
    if value.starts_with('"') || value.starts_with("W/") {
        return value == etag(meta);
    }
    match (httpdate::parse_http_date(value), meta.modified()) {
        (Ok(date), Ok(mtime)) => httpdate::fmt_http_date(mtime) == httpdate::fmt_http_date(date),
        _ => false,
    }
}

async fn guard(State(root): State<Arc<Root>>, mut req: Request, next: Next) -> Response {
    let Some(file) = resolve(&root, req.uri().path()) else {
        return (
            StatusCode::FORBIDDEN,
            "outside the served folder or not a file\n",
        )
            .into_response();
    };
    let is_get = matches!(*req.method(), Method::GET | Method::HEAD);
    let meta = std::fs::metadata(&file).ok().filter(|m| m.is_file());
    if let Some(meta) = &meta {
        // Ignoring Range is always allowed (200 with the whole body): for an empty file, whose
        // every range is unsatisfiable, and when If-Range names another version.
        let stale = req
            .headers()
            .get(header::IF_RANGE)
            .is_some_and(|v| !v.to_str().is_ok_and(|v| if_range_matches(v, meta)));
        if meta.len() == 0 || stale {
            req.headers_mut().remove(header::RANGE);
        }
    }
    let mut resp = next.run(req).await;
    if let (true, true, Some(meta)) = (is_get, resp.status().is_success(), &meta) {
        if let Ok(v) = HeaderValue::from_str(&etag(meta)) {
            resp.headers_mut().insert(header::ETAG, v);
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
    /// Seconds a client may take to send a request's headers before the connection is closed.
    #[arg(long, value_name = "SECS", default_value_t = 10,
          value_parser = clap::value_parser!(u64).range(1..=3600))]
    pub header_timeout: u64,
    /// Seconds a connection may go without a byte read or written before it is closed.
    #[arg(long, value_name = "SECS", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    pub idle_timeout: u64,
    /// Connections served at once (more wait in the listen queue); capped by the open-file
    /// limit, less 32 descriptors for the files being served.
    #[arg(long, value_name = "N", default_value_t = 256,
          value_parser = clap::value_parser!(u64).range(1..=65536))]
    pub max_connections: u64,
}

/// How many connections may be served at once: `wanted`, capped by the soft open-file limit
/// less 32 descriptors for the files being read.
fn connection_cap(wanted: u64) -> usize {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
            #[allow(clippy::unnecessary_cast)] // rlim_t is not u64 on every unix
            let fds = (lim.rlim_cur as u64).saturating_sub(32).max(1);
            return wanted.min(fds) as usize;
        }
    }
    wanted as usize
}

/// A path with repeated slashes collapsed (`//evil.example/x` -> `/evil.example/x`), so that no
/// redirect built from it is protocol-relative.
fn collapse_slashes(req: &mut axum::http::Request<hyper::body::Incoming>) {
    let path = req.uri().path();
    if !path.contains("//") {
        return;
    }
    let mut clean = String::with_capacity(path.len());
    for c in path.chars() {
        if !(c == '/' && clean.ends_with('/')) {
            clean.push(c);
        }
    }
    if let Some(q) = req.uri().query() {
        clean.push('?');
        clean.push_str(q);
    }
    if let Ok(pq) = clean.parse::<axum::http::uri::PathAndQuery>() {
        let mut parts = req.uri().clone().into_parts();
        parts.path_and_query = Some(pq);
        if let Ok(uri) = axum::http::Uri::from_parts(parts) {
            *req.uri_mut() = uri;
        }
    }
}

/// A connection that fails its pending read or write once `idle` has passed without a byte
/// read or written in either direction.
struct Idle<S> {
    inner: S,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
}

impl<S> Idle<S> {
    fn new(inner: S, idle: Duration) -> Self {
        Idle {
            inner,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
        }
    }

    fn progress(&mut self) {
        let at = tokio::time::Instant::now() + self.idle;
        self.timer.as_mut().reset(at);
    }

    /// After the inner stream said `Pending`: an error if the connection has been idle too long.
    fn check(&mut self, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        match self.timer.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                "connection idle",
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl<S: tokio::io::AsyncRead + Unpin> tokio::io::AsyncRead for Idle<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let before = buf.filled().len();
        match Pin::new(&mut self.inner).poll_read(cx, buf) {
            Poll::Ready(r) => {
                if buf.filled().len() > before {
                    self.progress();
                }
                Poll::Ready(r)
            }
            Poll::Pending => self.check(cx),
        }
    }
}

impl<S: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for Idle<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        match Pin::new(&mut self.inner).poll_write(cx, buf) {
            Poll::Ready(r) => {
                if matches!(r, Ok(n) if n > 0) {
                    self.progress();
                }
                Poll::Ready(r)
            }
            Poll::Pending => self.check(cx).map(|r| r.map(|()| 0)),
        }
    }
    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        match Pin::new(&mut self.inner).poll_flush(cx) {
            Poll::Pending => self.check(cx),
            r => r,
        }
    }
    fn poll_shutdown(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// Accepts connections while fewer than `cap` are open and serves each with hyper's HTTP/1
/// server under the header-read and idle timeouts.
async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: Router,
    cap: usize,
    header_timeout: Duration,
    idle_timeout: Duration,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(cap));
    loop {
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let stream = match listener.accept().await {
            Ok((s, _)) => s,
            Err(_) => {
                // Out of descriptors or a connection reset before accept: wait, retry.
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let app = app.clone();
        tokio::spawn(async move {
            let io = hyper_util::rt::TokioIo::new(Idle::new(stream, idle_timeout));
            let svc = hyper::service::service_fn(move |mut req| {
                collapse_slashes(&mut req);
                let mut app = app.clone();
                async move { tower::Service::call(&mut app, req).await }
            });
            let _ = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(io, svc)
                .await;
            drop(permit);
        });
    }
}

/// Serves the folder until interrupted.
pub fn run(a: &ServeArgs) -> Result<()> {
    let (dir, mounts, addr) = (a.dir.as_path(), a.mounts.as_slice(), a.addr.as_str());
    let addr: SocketAddr = addr
        .parse()
        .with_context(|| format!("--addr '{addr}': expected IP:PORT"))?;
    let app = app(dir, mounts)?;
    let cap = connection_cap(a.max_connections);
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
        let _ = writeln!(
            out,
            "{cap} connections at once, {} s to send headers, closed after {} s idle",
            a.header_timeout, a.idle_timeout
        );
        let _ = out.flush();
        tokio::select! {
            _ = serve_connections(
                listener,
                app,
                cap,
                Duration::from_secs(a.header_timeout),
                Duration::from_secs(a.idle_timeout),
            ) => Ok(()),
            _ = tokio::signal::ctrl_c() => Ok(()),
        }
    })
}
