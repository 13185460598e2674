//! Connections of `nibble serve`, served by hyper directly: a client gets `--header-timeout`
//! seconds to send a request's headers, a connection with no byte read or written for
//! `--idle-timeout` seconds is closed, and at most `--max-connections` (capped by the open-file
//! limit) are served at once; further ones wait in the listen queue.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};
use std::time::Duration;

use axum::Router;

/// How many connections may be served at once: `wanted`, capped by the soft open-file limit
/// less 32 descriptors for the files being read.
pub(super) fn connection_cap(wanted: u64) -> usize {
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
/// read or written in either direction, unless `busy` says a response is being produced (the
/// API server: a completion may take minutes before its first byte).
struct Idle<S> {
    inner: S,
    idle: Duration,
    timer: Pin<Box<tokio::time::Sleep>>,
    busy: Option<Arc<AtomicUsize>>,
}

impl<S> Idle<S> {
    fn new(inner: S, idle: Duration, busy: Option<Arc<AtomicUsize>>) -> Self {
        Idle {
            inner,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            busy,
        }
    }

    fn progress(&mut self) {
        let at = tokio::time::Instant::now() + self.idle;
        self.timer.as_mut().reset(at);
    }

    /// After the inner stream said `Pending`: an error if the connection has been idle too long.
    fn check(&mut self, cx: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
        if self
            .busy
            .as_ref()
            .is_some_and(|b| b.load(Ordering::Relaxed) > 0)
        {
            self.progress();
        }
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

/// Counts a response in production on its connection until its body is done or dropped.
struct Busy(Arc<AtomicUsize>);

impl Busy {
    fn new(count: &Arc<AtomicUsize>) -> Self {
        count.fetch_add(1, Ordering::Relaxed);
        Busy(count.clone())
    }
}

impl Drop for Busy {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Accepts connections while fewer than `cap` are open and serves each with hyper's HTTP/1
/// server under the header-read and idle timeouts; with `busy_is_not_idle` a connection whose
/// response is being produced (computed, or its body still streaming) is not idle.
pub(super) async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: Router,
    cap: usize,
    header_timeout: Duration,
    idle_timeout: Duration,
    busy_is_not_idle: bool,
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
            let busy = busy_is_not_idle.then(|| Arc::new(AtomicUsize::new(0)));
            let io = hyper_util::rt::TokioIo::new(Idle::new(stream, idle_timeout, busy.clone()));
            let svc = hyper::service::service_fn(move |mut req| {
                collapse_slashes(&mut req);
                let mut app = app.clone();
                let guard = busy.as_ref().map(Busy::new);
                async move {
                    let resp = tower::Service::call(&mut app, req).await?;
                    let Some(guard) = guard else {
                        return Ok(resp);
                    };
                    // Busy until the body is done or dropped.
                    Ok::<_, std::convert::Infallible>(resp.map(|b| {
                        use http_body_util::BodyExt;
                        axum::body::Body::new(b.map_frame(move |f| {
                            let _held = &guard;
                            f
                        }))
                    }))
                }
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
