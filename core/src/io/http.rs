//! HTTP(S) byte ranges as a [`RangeSource`] (native; the browser has its own `fetch` source).
//!
//! Opening a file takes two requests (bytes 0-7, then the header); after that only the ranges of
//! the tensors in the plan are fetched. Every data response must be `206` with a `Content-Range`
//! equal to what was asked; `ETag` / `Last-Modified` are pinned when the file is opened and
//! checked on every response. Connection errors, resets, short bodies and 5xx are retried with
//! exponential backoff, resuming from the last byte received; 4xx is not retried. A `200` to a
//! ranged request (a server that ignores `Range`) is an error naming the URL, unless the file is
//! small enough to read whole and the caller allowed that.

use std::io::Read;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::format::safetensors::SafetensorsHeader;
use crate::io::source::{RangeSource, SourceFile};

/// Knobs of the HTTP client.
#[derive(Debug, Clone)]
pub struct HttpOptions {
    /// Attempts per request after the first (connection errors, resets, short bodies, 5xx).
    pub retries: u32,
    /// First backoff; doubles per attempt without progress.
    pub backoff: Duration,
    /// Connect / response timeout.
    pub timeout: Duration,
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

/// Files served over HTTP(S), read by Range requests.
#[derive(Debug)]
pub struct HttpSource {
    agent: ureq::Agent,
    opts: HttpOptions,
    files: Vec<SourceFile>,
    validators: Vec<Validators>,
    bytes_received: AtomicU64,
    requests: AtomicU64,
    retries_done: AtomicU64,
    full_bodies: Mutex<Vec<Option<Vec<u8>>>>,
}

enum Attempt {
    /// Retry (after backoff), with a reason for the final error.
    Retry(String),
    /// Give up now.
    Fatal(Error),
}

fn header(resp: &ureq::http::Response<ureq::Body>, name: &str) -> Option<String> {
    resp.headers()
        .get(name)
        .and_then(|v| v.to_str().ok())
        .map(|s| s.to_string())
}

use crate::io::source::parse_content_range;

impl HttpSource {
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
        HttpSource {
            agent: ureq::Agent::new_with_config(config),
            opts,
            files: Vec::new(),
            validators: Vec::new(),
            bytes_received: AtomicU64::new(0),
            requests: AtomicU64::new(0),
            retries_done: AtomicU64::new(0),
            full_bodies: Mutex::new(Vec::new()),
        }
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

    /// The validators pinned for a file.
    pub fn validators(&self, file: usize) -> Option<&Validators> {
        self.validators.get(file)
    }

    /// GETs a small whole file (config.json, an index JSON); `Ok(None)` on 404.
    pub fn get_small(&self, url: &str, limit: u64) -> Result<Option<Vec<u8>>> {
        let mut attempt = 0;
        loop {
            self.requests.fetch_add(1, Ordering::Relaxed);
            let outcome = match self.agent.get(url).call() {
                Ok(resp) => {
                    let status = resp.status().as_u16();
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
                Attempt::Fatal(e) => return Err(e),
                Attempt::Retry(why) => {
                    if attempt >= self.opts.retries {
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

    /// Opens a safetensors file by URL: bytes 0-7 (header length and, from `Content-Range`,
    /// the file length), then the header. Returns its index in `files()` and the header.
    pub fn open_file(&mut self, url: &str) -> Result<(usize, SafetensorsHeader)> {
        let idx = self.files.len();
        self.files.push(SourceFile {
            name: url.to_string(),
            len: u64::MAX,
        });
        self.validators.push(Validators::default());
        if let Ok(mut b) = self.full_bodies.lock() {
            b.push(None);
        }
        let mut first8 = [0u8; 8];
        let total = match self.fetch_range(idx, 0, &mut first8, "<header length>", true) {
            Ok(t) => t,
            Err(e) => {
                self.files.pop();
                self.validators.pop();
                return Err(e);
            }
        };
        self.files[idx].len = total;
        let header_len = SafetensorsHeader::parse_header_len(url, &first8, total)?;
        let mut header = vec![0u8; header_len as usize];
        self.fetch_range(idx, 8, &mut header, "<header>", false)?;
        let h = SafetensorsHeader::parse(url, &header, total)?;
        Ok((idx, h))
    }

    /// One ranged read with retries and resume. With `pin`, records the validators and returns
    /// the total length from `Content-Range`; otherwise checks them.
    fn fetch_range(
        &mut self,
        file: usize,
        offset: u64,
        buf: &mut [u8],
        what: &str,
        pin: bool,
    ) -> Result<u64> {
        let mut v = self.validators[file].clone();
        let total = self.range_get(file, offset, buf, what, &mut v, pin)?;
        if pin {
            self.validators[file] = v;
        }
        Ok(total)
    }

    fn range_get(
        &self,
        file: usize,
        offset: u64,
        buf: &mut [u8],
        what: &str,
        pinned: &mut Validators,
        pin: bool,
    ) -> Result<u64> {
        let url = self.files[file].name.clone();
        let known_len = self.files[file].len;
        if buf.is_empty() {
            return Ok(known_len);
        }
        if let Some(whole) = self
            .full_bodies
            .lock()
            .ok()
            .and_then(|b| b.get(file).cloned().flatten())
        {
            let s = offset as usize;
            buf.copy_from_slice(&whole[s..s + buf.len()]);
            return Ok(whole.len() as u64);
        }
        let mut got = 0usize;
        let mut attempt = 0u32;
        let mut total_seen = known_len;
        loop {
            let start = offset + got as u64;
            let end = offset + buf.len() as u64 - 1;
            self.requests.fetch_add(1, Ordering::Relaxed);
            let before = got;
            let outcome: Attempt = (|| {
                let resp = match self
                    .agent
                    .get(&url)
                    .header("Range", format!("bytes={start}-{end}"))
                    .call()
                {
                    Ok(r) => r,
                    Err(e) => return Attempt::Retry(format!("request failed: {e}")),
                };
                let status = resp.status().as_u16();
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
                    if pinned.etag.is_some() && etag.is_some() && pinned.etag != etag {
                        return fatal(format!(
                            "the file changed during the run (ETag {} became {})",
                            pinned.etag.as_deref().unwrap_or(""),
                            etag.as_deref().unwrap_or("")
                        ));
                    }
                    if pinned.last_modified.is_some() && lm.is_some() && pinned.last_modified != lm
                    {
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
                        if let Ok(mut b) = self.full_bodies.lock() {
                            b[file] = Some(whole);
                        }
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
                Attempt::Fatal(e) => return Err(e),
                Attempt::Retry(_) if got == buf.len() => return Ok(total_seen),
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

impl RangeSource for HttpSource {
    fn files(&self) -> &[SourceFile] {
        &self.files
    }

    fn read_exact_at(&self, file: usize, offset: u64, buf: &mut [u8], what: &str) -> Result<()> {
        self.check_range(file, offset, buf.len() as u64, what)?;
        let mut v = self.validators[file].clone();
        self.range_get(file, offset, buf, what, &mut v, false)
            .map(|_| ())
    }
}
