//! HTTP(S) transport (native; the browser has its own `fetch`): an [`HttpClient`] that returns
//! bytes, the [`HttpSource`] that streams a model's files through it, and the [`HttpFolder`] a
//! model URL is opened through.
//!
//! Opening a file takes one request (bytes 0-7, which also gives the file's length); its header is
//! a second; after that only the ranges of the tensors in the plan are fetched. Every data
//! response must be `206` with a `Content-Range` equal to what was asked; `ETag` /
//! `Last-Modified` are pinned when the file is opened and checked on every response (one that
//! disappears counts as a change). Connection errors, resets, short bodies and 5xx are retried
//! with exponential backoff, resuming from the last byte received; 4xx is not retried. A `200` to
//! a ranged request (a server that ignores `Range`) is an error naming the URL, unless the file
//! is small enough to read whole and the caller allowed that.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::error::{Error, Result};
use crate::io::folder::{percent_encode_path, BoxFuture, ModelFolder, OpenedFile};
use crate::io::source::{parse_content_range, RangeSource, SourceFile};

/// Knobs of the HTTP client.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Attempts per request after the first (connection errors, resets, short bodies, 5xx).
    pub retries: u32,
    /// First backoff; doubles per attempt without progress.
    pub backoff: Duration,
    /// Connect / response timeout, and the fixed part of each request's deadline.
    pub timeout: Duration,
    /// The slowest transfer rate (bytes/s) a body may take before its request is cut off and
    /// retried from the last byte received: each request's deadline, which covers the whole
    /// response (connect, headers and body), is `timeout + bytes / min_rate`, so that a server
    /// that stops mid-body cannot hang a run.
    pub min_rate: u64,
    /// Files up to this size may be read whole when a server ignores `Range` (0: never).
    pub allow_whole_file_below: u64,
    /// Idle keep-alive connections kept per host (one per reader thread is enough).
    pub connections: usize,
}

impl Default for HttpOptions {
    fn default() -> Self {
        HttpOptions {
            retries: 5,
            backoff: Duration::from_millis(100),
            timeout: Duration::from_secs(30),
            min_rate: 1 << 20,
            allow_whole_file_below: 0,
            connections: 8,
        }
    }
}

/// `ETag` and `Last-Modified` seen when a file was opened.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Validators {
    /// `ETag`, if the server sent one.
    pub etag: Option<String>,
    /// `Last-Modified`, if the server sent one.
    pub last_modified: Option<String>,
}

/// A file the client has opened.
#[derive(Debug, Clone)]
struct OpenFile {
    url: String,
    len: u64,
    validators: Validators,
    /// The whole file, when a server that ignores ranges sent it and it was small enough.
    whole: Option<Arc<Vec<u8>>>,
}

/// An HTTP(S) client that returns bytes: small whole files, and ranges of the files it opened
/// (numbered in the order they were opened), checked as the module says.
#[derive(Debug)]
pub struct HttpClient {
    agent: ureq::Agent,
    opts: HttpOptions,
    files: Mutex<Vec<OpenFile>>,
    bytes_received: AtomicU64,
    requests: AtomicU64,
    retries_done: AtomicU64,
}

enum Attempt {
    /// Retry (after backoff), with a reason for the final error.
    Retry(String),
    /// Give up now.
    Fatal(Error),
    /// A 404 where absence is an answer (opening a file, a side file).
    NotFound,
}

/// What a ranged read got.
enum Ranged {
    /// The file's total length, and its whole body when the server sent all of it.
    Got(u64, Option<Vec<u8>>),
    NotFound,
}

fn header(resp: &ureq::http::Response<ureq::Body>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.to_string())
}

impl HttpClient {
    /// A client with no files yet.
    pub fn new(opts: HttpOptions) -> Self {
        let config = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_connect(Some(opts.timeout))
            .timeout_recv_response(Some(opts.timeout))
            .max_idle_connections_per_host(opts.connections.max(1))
            .max_idle_connections(opts.connections.max(1) * 4)
            .user_agent(format!("nibble/{}", env!("CARGO_PKG_VERSION")))
            .build();
        HttpClient {
            agent: ureq::Agent::new_with_config(config),
            opts,
            files: Mutex::new(Vec::new()),
            bytes_received: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            retries_done: AtomicU64::new(0),
        }
    }

    /// The deadline of a request whose body is `bytes` long (see [`HttpOptions::min_rate`]).
    fn deadline(&self, bytes: u64) -> Duration {
        let per_byte = Duration::from_secs_f64(1.0 / self.opts.min_rate.max(1) as f64);
        self.opts.timeout + per_byte.saturating_mul(bytes.min(u32::MAX as u64) as u32)
    }

    /// Body bytes received so far (all requests).
    pub fn bytes_received(&self) -> u64 {
        self.bytes_received.load(Ordering::Relaxed)
    }

    /// Requests sent so far (retries included).
    pub fn requests(&self) -> u64 {
        self.requests.load(Ordering::Relaxed)
    }

    /// Retries done so far.
    pub fn retries(&self) -> u64 {
        self.retries_done.load(Ordering::Relaxed)
    }

    /// The validators pinned for opened file `file`.
    pub fn validators(&self, file: usize) -> Option<Validators> {
        self.files
            .lock()
            .ok()?
            .get(file)
            .map(|f| f.validators.clone())
    }

    fn file(&self, file: usize) -> Result<OpenFile> {
        self.files
            .lock()
            .map_err(|_| Error::Invalid("http client poisoned".into()))?
            .get(file)
            .cloned()
            .ok_or_else(|| Error::Invalid(format!("no opened file #{file}")))
    }

    /// Opens `url` for ranged reads: its first bytes (up to 8) and its length from
    /// `Content-Range`, validators pinned. `None` on 404.
    pub fn open(&self, url: &str) -> Result<Option<OpenedFile>> {
        let mut head = [0u8; 8];
        let mut v = Validators::default();
        let (len, whole) =
            match self.range(url, u64::MAX, 0, &mut head, "<header length>", &mut v, true)? {
                Ranged::NotFound => return Ok(None),
                Ranged::Got(len, whole) => (len, whole),
            };
        let mut files = self
            .files
            .lock()
            .map_err(|_| Error::Invalid("http client poisoned".into()))?;
        files.push(OpenFile {
            url: url.to_string(),
            len,
            validators: v,
            whole: whole.map(Arc::new),
        });
        Ok(Some(OpenedFile {
            index: files.len() - 1,
            len,
            head: head[..len.min(8) as usize].to_vec(),
        }))
    }

    /// Fills `buf` from `offset` of opened file `file`; `what` names the tensor for errors.
    pub fn read(&self, file: usize, offset: u64, buf: &mut [u8], what: &str) -> Result<()> {
        let f = self.file(file)?;
        if let Some(whole) = &f.whole {
            let s = offset as usize;
            let piece = whole
                .get(s..s + buf.len())
                .ok_or_else(|| Error::OffsetOutOfRange {
                    file: f.url.clone(),
                    tensor: what.to_string(),
                    offset,
                    end: offset + buf.len() as u64,
                    file_len: whole.len() as u64,
                })?;
            buf.copy_from_slice(piece);
            return Ok(());
        }
        let mut v = f.validators.clone();
        match self.range(&f.url, f.len, offset, buf, what, &mut v, false)? {
            Ranged::Got(..) => Ok(()),
            Ranged::NotFound => Err(Error::Model {
                file: f.url,
                msg: format!("{what}: HTTP 404"),
            }),
        }
    }

    /// GETs a small whole file (config.json, an index JSON); `Ok(None)` on 404. All attempts
    /// together get one deadline, `timeout + size / min_rate`, the size being what the server's
    /// `Content-Length` says (1 MiB until it has said): a server that stalls mid-file ends the
    /// call in about `timeout`, not `limit / min_rate` per attempt.
    pub fn get_small(&self, url: &str, limit: u64) -> Result<Option<Vec<u8>>> {
        let mut attempt = 0;
        let started = Instant::now();
        let mut expect = limit.min(1 << 20);
        loop {
            let left = self.deadline(expect).saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(Error::Model {
                    file: url.to_string(),
                    msg: format!(
                        "no whole answer within {:.0} s ({attempt} attempts)",
                        self.deadline(expect).as_secs_f64()
                    ),
                });
            }
            self.requests.fetch_add(1, Ordering::Relaxed);
            let outcome = match self
                .agent
                .get(url)
                .config()
                .timeout_global(Some(left))
                .build()
                .call()
            {
                Ok(resp) => {
                    let status = resp.status().as_u16();
                    let declared = resp
                        .headers()
                        .get("content-length")
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.trim().parse::<u64>().ok());
                    if status == 404 {
                        return Ok(None);
                    }
                    if (500..600).contains(&status) {
                        Attempt::Retry(format!("HTTP {status}"))
                    } else if status != 200 {
                        return Err(Error::Model {
                            file: url.to_string(),
                            msg: format!("HTTP {status}"),
                        });
                    } else if declared.is_some_and(|n| n > limit) {
                        return Err(Error::Model {
                            file: url.to_string(),
                            msg: format!(
                                "{} bytes, larger than the {limit}-byte limit for this file",
                                declared.unwrap_or(0)
                            ),
                        });
                    } else if let Some(n) = declared.filter(|&n| n > expect) {
                        // A larger file than guessed: asked again with its own deadline.
                        expect = n;
                        continue;
                    } else {
                        let mut body = Vec::new();
                        match resp
                            .into_body()
                            .into_reader()
                            .take(limit + 1)
                            .read_to_end(&mut body)
                        {
                            Ok(_) if body.len() as u64 > limit => {
                                return Err(Error::Model {
                                    file: url.to_string(),
                                    msg: format!(
                                        "larger than the {limit}-byte limit for this file"
                                    ),
                                })
                            }
                            Ok(_) => {
                                self.bytes_received
                                    .fetch_add(body.len() as u64, Ordering::Relaxed);
                                return Ok(Some(body));
                            }
                            Err(e) => Attempt::Retry(e.to_string()),
                        }
                    }
                }
                Err(e) => Attempt::Retry(e.to_string()),
            };
            match outcome {
                Attempt::NotFound => return Ok(None),
                Attempt::Fatal(e) => return Err(e),
                Attempt::Retry(why) => {
                    if attempt >= self.opts.retries || started.elapsed() >= self.deadline(expect) {
                        return Err(Error::Model {
                            file: url.to_string(),
                            msg: format!("giving up after {} attempts: {why}", attempt + 1),
                        });
                    }
                    std::thread::sleep(self.opts.backoff * 2u32.saturating_pow(attempt));
                    self.retries_done.fetch_add(1, Ordering::Relaxed);
                    attempt += 1;
                }
            }
        }
    }

    /// One ranged read of `url` with retries and resume into `buf`. With `pin` (opening the
    /// file: `known_len` is `u64::MAX`), records the validators and a 404 is `NotFound`;
    /// otherwise the validators are checked against `pinned`. Returns the file's total length
    /// and, when the server sent the whole file (allowed for small files), its bytes.
    #[allow(clippy::too_many_arguments)]
    fn range(
        &self,
        url: &str,
        known_len: u64,
        offset: u64,
        buf: &mut [u8],
        what: &str,
        pinned: &mut Validators,
        pin: bool,
    ) -> Result<Ranged> {
        let url = url.to_string();
        if buf.is_empty() {
            return Ok(Ranged::Got(known_len, None));
        }
        let mut whole_body = None;
        let mut got = 0usize;
        let mut attempt = 0u32;
        let mut total_seen = known_len;
        // Attempts that progress do not count against the retries, so the read as a whole has
        // a deadline too: the whole range's, plus `timeout` for each retry allowed. A server
        // that sends a byte per attempt cannot keep a read going forever.
        let started = Instant::now();
        let overall = self
            .deadline(buf.len() as u64)
            .saturating_add(self.opts.timeout.saturating_mul(self.opts.retries));
        loop {
            let start = offset + got as u64;
            let end = offset + buf.len() as u64 - 1;
            let left = overall.saturating_sub(started.elapsed());
            if left.is_zero() {
                return Err(Error::Model {
                    file: url,
                    msg: format!(
                        "{what} at offset {offset}: giving up: {} of {} bytes within {:.0} s",
                        got,
                        buf.len(),
                        overall.as_secs_f64()
                    ),
                });
            }
            self.requests.fetch_add(1, Ordering::Relaxed);
            let before = got;
            let outcome: Attempt = (|| {
                let resp = match self
                    .agent
                    .get(&url)
                    .header("Range", format!("bytes={start}-{end}"))
                    .config()
                    .timeout_global(Some(self.deadline(end + 1 - start).min(left)))
                    .build()
                    .call()
                {
                    Ok(r) => r,
                    Err(e) => return Attempt::Retry(format!("request failed: {e}")),
                };
                let status = resp.status().as_u16();
                if pin && got == 0 && status == 404 {
                    return Attempt::NotFound;
                }
                let fatal = |msg: String| {
                    Attempt::Fatal(Error::Model {
                        file: url.clone(),
                        msg: format!("{what} at offset {start}: {msg}"),
                    })
                };
                if (500..600).contains(&status) {
                    return Attempt::Retry(format!("HTTP {status}"));
                }
                let etag = header(&resp, "etag");
                let lm = header(&resp, "last-modified");
                if pin && got == 0 {
                    pinned.etag = etag.clone();
                    pinned.last_modified = lm.clone();
                } else {
                    // A validator that was there and is gone is a change too: the bytes may be
                    // another file's.
                    if pinned.etag.is_some() && pinned.etag != etag {
                        return fatal(format!(
                            "the file changed during the run (ETag {} became {})",
                            pinned.etag.as_deref().unwrap_or(""),
                            etag.as_deref().unwrap_or("")
                        ));
                    }
                    if pinned.last_modified.is_some() && pinned.last_modified != lm {
                        return fatal(
                            "the file changed during the run (Last-Modified differs)".into(),
                        );
                    }
                }
                if status == 200 {
                    let len = header(&resp, "content-length").and_then(|v| v.parse::<u64>().ok());
                    let allowed = self.opts.allow_whole_file_below;
                    if let Some(len) = len.filter(|&l| allowed > 0 && l <= allowed) {
                        let mut whole = Vec::with_capacity(len as usize);
                        if let Err(e) = resp
                            .into_body()
                            .into_reader()
                            .take(len)
                            .read_to_end(&mut whole)
                        {
                            return Attempt::Retry(e.to_string());
                        }
                        if (whole.len() as u64) < offset + buf.len() as u64 {
                            return fatal(format!(
                                "whole body of {} bytes is too short",
                                whole.len()
                            ));
                        }
                        self.bytes_received
                            .fetch_add(whole.len() as u64, Ordering::Relaxed);
                        buf[got..].copy_from_slice(&whole[start as usize..=end as usize]);
                        got = buf.len();
                        total_seen = whole.len() as u64;
                        whole_body = Some(whole);
                        return Attempt::Retry(String::new());
                    }
                    return fatal(
                        "the server ignored the Range header (200 OK instead of 206 Partial Content); \
                         serve the model with a server that supports byte ranges, e.g. `nibble serve`"
                            .into(),
                    );
                }
                if status != 206 {
                    return fatal(format!("HTTP {status} (expected 206 Partial Content)"));
                }
                let cr = header(&resp, "content-range");
                match cr.as_deref().and_then(parse_content_range) {
                    Some((a, b, t)) if a == start && b == end => {
                        if let Some(t) = t {
                            if known_len != u64::MAX && t != known_len {
                                return fatal(format!(
                                    "the file's length changed from {known_len} to {t}"
                                ));
                            }
                            total_seen = t;
                        } else if known_len == u64::MAX {
                            return fatal("Content-Range does not give the file's length".into());
                        }
                    }
                    _ => {
                        return fatal(format!(
                            "Content-Range {:?} does not match the requested bytes {start}-{end}",
                            cr.unwrap_or_default()
                        ))
                    }
                }
                let mut reader = resp.into_body().into_reader();
                while got < buf.len() {
                    match reader.read(&mut buf[got..]) {
                        Ok(0) => {
                            return Attempt::Retry(format!(
                                "body ended after {} of {} bytes",
                                got - before,
                                end + 1 - start
                            ))
                        }
                        Ok(n) => {
                            got += n;
                            self.bytes_received.fetch_add(n as u64, Ordering::Relaxed);
                        }
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                        Err(e) => {
                            return Attempt::Retry(format!(
                                "connection error after {} bytes: {e}",
                                got - before
                            ))
                        }
                    }
                }
                Attempt::Retry(String::new())
            })();
            match outcome {
                Attempt::NotFound => return Ok(Ranged::NotFound),
                Attempt::Fatal(e) => return Err(e),
                Attempt::Retry(_) if got == buf.len() => {
                    return Ok(Ranged::Got(total_seen, whole_body.take()))
                }
                Attempt::Retry(why) => {
                    if got > before {
                        // Progress was made: resume from the last byte without counting it
                        // against the retry budget.
                        attempt = 0;
                    }
                    if attempt >= self.opts.retries {
                        return Err(Error::Model {
                            file: url,
                            msg: format!(
                                "{what} at offset {start}: giving up after {} attempts: {why}",
                                attempt + 1
                            ),
                        });
                    }
                    std::thread::sleep(self.opts.backoff * 2u32.saturating_pow(attempt));
                    self.retries_done.fetch_add(1, Ordering::Relaxed);
                    attempt += 1;
                }
            }
        }
    }
}

/// A model's files over HTTP, as a [`RangeSource`]: the files a client opened.
#[derive(Debug)]
pub struct HttpSource {
    client: Arc<HttpClient>,
    files: Vec<SourceFile>,
}

impl HttpSource {
    /// The files `client` has opened so far.
    pub fn new(client: Arc<HttpClient>) -> Result<Self> {
        let files = client
            .files
            .lock()
            .map_err(|_| Error::Invalid("http client poisoned".into()))?
            .iter()
            .map(|f| SourceFile {
                name: f.url.clone(),
                len: f.len,
            })
            .collect();
        Ok(HttpSource { client, files })
    }

    /// The client (request counts, validators).
    pub fn client(&self) -> &HttpClient {
        &self.client
    }
}

impl RangeSource for HttpSource {
    fn files(&self) -> &[SourceFile] {
        &self.files
    }

    fn read_exact_at(&self, file: usize, offset: u64, buf: &mut [u8], what: &str) -> Result<()> {
        self.check_range(file, offset, buf.len() as u64, what)?;
        self.client.read(file, offset, buf, what)
    }

    fn version(&self, file: usize) -> Option<String> {
        let v = self.client.validators(file)?;
        (v.etag.is_some() || v.last_modified.is_some()).then(|| {
            format!(
                "etag {} last-modified {}",
                v.etag.unwrap_or_default(),
                v.last_modified.unwrap_or_default()
            )
        })
    }
}

/// A model folder at an HTTP(S) base URL (or the folder of a `.safetensors` URL).
#[derive(Debug)]
pub struct HttpFolder {
    base: String,
    client: Arc<HttpClient>,
}

impl HttpFolder {
    /// The folder at `base` (without a trailing slash).
    pub fn new(base: &str, opts: HttpOptions) -> Self {
        HttpFolder {
            base: base.trim_end_matches('/').to_string(),
            client: Arc::new(HttpClient::new(opts)),
        }
    }

    /// The client (request counts).
    pub fn client(&self) -> &Arc<HttpClient> {
        &self.client
    }
}

impl ModelFolder for HttpFolder {
    fn root(&self) -> &str {
        &self.base
    }

    fn locate(&self, name: &str) -> String {
        format!("{}/{}", self.base, percent_encode_path(name))
    }

    fn read_small<'a>(
        &'a self,
        name: &'a str,
        limit: u64,
    ) -> BoxFuture<'a, Result<Option<Vec<u8>>>> {
        Box::pin(async move { self.client.get_small(&self.locate(name), limit) })
    }

    fn open_file<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<OpenedFile>>> {
        Box::pin(async move { self.client.open(&self.locate(name)) })
    }

    fn read_at<'a>(
        &'a self,
        file: usize,
        offset: u64,
        len: u64,
        what: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u8>>> {
        Box::pin(async move {
            let n =
                usize::try_from(len).map_err(|_| Error::Invalid(format!("{what}: {len} bytes")))?;
            let mut buf = vec![0u8; n];
            self.client.read(file, offset, &mut buf, what)?;
            Ok(buf)
        })
    }

    fn list_safetensors(&self) -> Result<Option<Vec<String>>> {
        Ok(None)
    }

    fn source(&self) -> Result<Arc<dyn RangeSource>> {
        Ok(Arc::new(HttpSource::new(self.client.clone())?))
    }

    fn missing(&self, name: &str) -> Error {
        Error::Model {
            file: self.locate(name),
            msg: "HTTP 404 (not found)".into(),
        }
    }
}
