//! Connections of `nibble serve`, served by hyper directly: a client gets `--header-timeout`
//! seconds to send a request's headers (and the API server `--body-timeout` seconds to send its
//! body), a connection with no byte read or written for `--idle-timeout` seconds is closed
//! (while its request is still being sent too), and at most `--max-connections` (capped by the
//! open-file limit) are served at once; further ones wait in the listen queue, and when one is
//! waiting the connection that has moved no byte for longest (2 s or more) is closed for it.

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
    tracked: Arc<Tracked>,
}

impl<S> Idle<S> {
    fn new(inner: S, idle: Duration, tracked: Arc<Tracked>) -> Self {
        Idle {
            inner,
            idle,
            timer: Box::pin(tokio::time::sleep(idle)),
            busy: tracked.busy.clone(),
            tracked,
        }
    }

    fn progress(&mut self) {
        let at = tokio::time::Instant::now() + self.idle;
        self.timer.as_mut().reset(at);
        self.tracked.moved();
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

/// Where a request's [`Busy`] mark is held: set once its body has been read whole, kept by the
/// response's body until that is done.
type Mark = Arc<std::sync::Mutex<Option<Busy>>>;

/// A request body that marks its connection busy once it has been read to the end: until then
/// the client is sending, and the idle timer applies to it like to any other client.
struct MarkWhenRead {
    inner: hyper::body::Incoming,
    count: Arc<AtomicUsize>,
    mark: Mark,
}

impl MarkWhenRead {
    fn mark_busy(&self) {
        let mut m = self.mark.lock().unwrap_or_else(|e| e.into_inner());
        if m.is_none() {
            *m = Some(Busy::new(&self.count));
        }
    }
}

impl hyper::body::Body for MarkWhenRead {
    type Data = hyper::body::Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
    ) -> Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        let r = Pin::new(&mut self.inner).poll_frame(cx);
        if matches!(r, Poll::Ready(None)) || self.inner.is_end_stream() {
            self.mark_busy();
        }
        r
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.inner.size_hint()
    }
}

/// Milliseconds since the first call: the connections' clock.
fn now_ms() -> u64 {
    static START: std::sync::OnceLock<std::time::Instant> = std::sync::OnceLock::new();
    START
        .get_or_init(std::time::Instant::now)
        .elapsed()
        .as_millis() as u64
}

/// What the accept loop knows of an open connection: when it last moved a byte, whether a
/// response is being produced on it, and how to close it.
struct Tracked {
    last: std::sync::atomic::AtomicU64,
    busy: Option<Arc<AtomicUsize>>,
    close: tokio::sync::Notify,
}

impl Tracked {
    fn moved(&self) {
        self.last.store(now_ms(), Ordering::Relaxed);
    }

    fn stalled_ms(&self) -> u64 {
        now_ms().saturating_sub(self.last.load(Ordering::Relaxed))
    }

    fn is_busy(&self) -> bool {
        self.busy
            .as_ref()
            .is_some_and(|b| b.load(Ordering::Relaxed) > 0)
    }
}

/// How long a connection must have moved no byte before a new client may take its place when
/// every connection slot is taken.
const STALLED: Duration = Duration::from_secs(2);

/// The open connections, for making room: when all `--max-connections` are taken and another
/// client is waiting, the one stalled longest (at least [`STALLED`], and not producing a
/// response) is closed for it. Without this, clients that stop reading or sending (a slow-read
/// attack, or simply many stuck clients) hold every slot until the idle timeout, and nobody
/// else is answered meanwhile.
#[derive(Default)]
struct Open(std::sync::Mutex<Vec<std::sync::Weak<Tracked>>>);

impl Open {
    fn add(&self, t: &Arc<Tracked>) {
        let mut v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(t));
    }

    /// Closes the connection stalled longest, if one has been stalled [`STALLED`] or more.
    fn close_stalled(&self) -> bool {
        let v = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let worst = v
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .filter(|t| !t.is_busy() && t.stalled_ms() >= STALLED.as_millis() as u64)
            .max_by_key(|t| t.stalled_ms());
        match worst {
            Some(t) => {
                // Not chosen twice while it closes.
                t.moved();
                t.close.notify_one();
                true
            }
            None => false,
        }
    }
}

/// Accepts connections while fewer than `cap` are open and serves each with hyper's HTTP/1
/// server under the header-read and idle timeouts; with `busy_is_not_idle` a connection whose
/// response is being produced (computed, or its body still streaming) is not idle. When all
/// `cap` are open and a client waits, a stalled connection makes room ([`Open`]).
pub(super) async fn serve_connections(
    listener: tokio::net::TcpListener,
    app: Router,
    cap: usize,
    header_timeout: Duration,
    idle_timeout: Duration,
    busy_is_not_idle: bool,
) {
    let slots = Arc::new(tokio::sync::Semaphore::new(cap));
    let open = Arc::new(Open::default());
    let accept = || async {
        match listener.accept().await {
            Ok((s, _)) => Some(s),
            Err(_) => {
                // Out of descriptors (the open connections' files count too) or a connection
                // reset before accept: make room if a connection is stalled, wait, retry.
                open.close_stalled();
                tokio::time::sleep(Duration::from_millis(50)).await;
                None
            }
        }
    };
    loop {
        let (permit, stream) = match slots.clone().try_acquire_owned() {
            Ok(permit) => match accept().await {
                Some(s) => (permit, s),
                None => continue,
            },
            Err(tokio::sync::TryAcquireError::Closed) => return,
            Err(tokio::sync::TryAcquireError::NoPermits) => {
                // Full: a slot frees, or a client arrives and a stalled connection makes room.
                let stream = tokio::select! {
                    p = slots.clone().acquire_owned() => {
                        drop(p);
                        continue;
                    }
                    s = accept() => match s {
                        Some(s) => s,
                        None => continue,
                    },
                };
                let permit = loop {
                    open.close_stalled();
                    let wait = slots.clone().acquire_owned();
                    match tokio::time::timeout(Duration::from_millis(250), wait).await {
                        Ok(Ok(p)) => break p,
                        Ok(Err(_)) => return,
                        Err(_) => continue,
                    }
                };
                (permit, stream)
            }
        };
        let tracked = Arc::new(Tracked {
            last: now_ms().into(),
            busy: busy_is_not_idle.then(|| Arc::new(AtomicUsize::new(0))),
            close: tokio::sync::Notify::new(),
        });
        open.add(&tracked);
        let app = app.clone();
        tokio::spawn(async move {
            let busy = tracked.busy.clone();
            let io = hyper_util::rt::TokioIo::new(Idle::new(stream, idle_timeout, tracked.clone()));
            let svc = hyper::service::service_fn(move |mut req| {
                collapse_slashes(&mut req);
                let mut app = app.clone();
                let mark: Mark = Default::default();
                let req = match &busy {
                    Some(count) => req.map(|inner| {
                        axum::body::Body::new(MarkWhenRead {
                            inner,
                            count: count.clone(),
                            mark: mark.clone(),
                        })
                    }),
                    None => req.map(axum::body::Body::new),
                };
                let counted = busy.is_some();
                async move {
                    let resp = tower::Service::call(&mut app, req).await?;
                    if !counted {
                        return Ok(resp);
                    }
                    // Busy until the response's body is done or dropped.
                    Ok::<_, std::convert::Infallible>(resp.map(|b| {
                        use http_body_util::BodyExt;
                        axum::body::Body::new(b.map_frame(move |f| {
                            let _held = &mark;
                            f
                        }))
                    }))
                }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(hyper_util::rt::TokioTimer::new())
                .header_read_timeout(header_timeout)
                .serve_connection(io, svc);
            // Closed by the accept loop to make room: dropping the connection closes its socket.
            tokio::select! {
                _ = conn => {}
                _ = tracked.close.notified() => {}
            }
            drop(permit);
        });
    }
}
