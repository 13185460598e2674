//! `nibble serve DIR`: a static file server for models and the browser demo. Byte ranges
//! (single range, RFC 9110: 206, 416, `Accept-Ranges`), `Last-Modified` and the file body come
//! from tower-http's `ServeDir`; this adds a strong `ETag` from size and modification time,
//! `If-Range` (a validator that does not match gets the whole file, 200), CORS headers (exposing
//! `Content-Range` and `ETag`) so that a page on another origin can stream, and a guard that
//! refuses every path that resolves outside DIR (`..`, `%2e%2e`, absolute paths, symlinks
//! pointing out, a folder's `index.html` included) or to something that is not a regular file,
//! with 403. Repeated slashes are collapsed before routing (see `conn`), so no redirect is
//! protocol-relative.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result};
use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::Router;
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
/// Serves the folder until interrupted.
pub(super) fn run(a: &super::ServeArgs, dir: &Path, addr: std::net::SocketAddr) -> Result<()> {
    let mounts = a.mounts.as_slice();
    let app = app(dir, mounts)?;
    super::runtime()?.block_on(super::serve_until_interrupted(a, addr, app, |local| {
        let mut lines = vec![format!(
            "serving {} at http://{local}/ (Ctrl-C to stop)",
            dir.display()
        )];
        for (name, path) in mounts {
            lines.push(format!(
                "serving {} at http://{local}/{name}/",
                path.display()
            ));
        }
        lines
    }))
}
