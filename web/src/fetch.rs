//! HTTP Range reads with the browser's `fetch`, checked the way the native HTTP source checks
//! them (206, a `Content-Range` equal to what was asked, the exact byte count, an `ETag` that
//! does not change during a run), retried with backoff on network errors, 5xx and requests
//! whose response and body do not arrive within their deadline (30 s plus the body at 1 MiB/s,
//! like the native source's; see [`set_response_timeout_ms`]); and the [`ByteSource`] that fills
//! staging-ring slots with them.

use std::collections::{HashMap, VecDeque};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Waker;
use std::time::Duration;

use nibble_core::io::folder::{percent_encode_path, BoxFuture, ModelFolder, OpenedFile};
use nibble_core::io::model::ModelIndex;
use nibble_core::io::source::{
    check_range, parse_content_range, ByteSource, RangeSource, ReadCompletion, ReadRequest,
    SourceFile,
};
use nibble_core::{Error, Result};
use wasm_bindgen::closure::Closure;
use wasm_bindgen::{JsCast, JsValue};
use wasm_bindgen_futures::JsFuture;
use web_time::Instant;

/// One request the page made.
#[derive(Debug, Clone)]
pub struct RequestLog {
    /// URL.
    pub url: String,
    /// The byte range asked for (inclusive end), `None` for a plain GET.
    pub range: Option<(u64, u64)>,
    /// HTTP status of the last attempt (0: network error).
    pub status: u16,
    /// Body bytes received.
    pub bytes: u64,
    /// What it was for: "header", "quant-state", "weights", "side-file".
    pub purpose: &'static str,
}

/// Every request and byte, shared by the sources and the API.
#[derive(Debug, Default)]
pub struct Traffic {
    /// In order.
    pub requests: Vec<RequestLog>,
    /// `ETag` (or `Last-Modified`) first seen per URL.
    validators: HashMap<String, String>,
}

impl Traffic {
    /// Forgets the `ETag`s seen (a new model is being opened).
    pub fn forget_validators(&mut self) {
        self.validators.clear();
    }

    /// Body bytes received for `purpose` (all purposes when `None`).
    pub fn bytes(&self, purpose: Option<&str>) -> u64 {
        self.requests
            .iter()
            .filter(|r| purpose.is_none_or(|p| r.purpose == p))
            .map(|r| r.bytes)
            .sum()
    }
}

/// Shared traffic counters.
pub type SharedTraffic = Arc<Mutex<Traffic>>;

fn http_err(url: &str, msg: String) -> Error {
    Error::Model {
        file: url.to_string(),
        msg,
    }
}

fn js_msg(e: &JsValue) -> String {
    e.as_string()
        .or_else(|| {
            e.dyn_ref::<js_sys::Error>()
                .map(|e| String::from(e.message()))
        })
        .unwrap_or_else(|| format!("{e:?}"))
}

/// `fetch` from the window or from a worker.
fn global_fetch(req: &web_sys::Request) -> std::result::Result<js_sys::Promise, JsValue> {
    let global = js_sys::global();
    if let Some(w) = global.dyn_ref::<web_sys::Window>() {
        Ok(w.fetch_with_request(req))
    } else if let Some(w) = global.dyn_ref::<web_sys::WorkerGlobalScope>() {
        Ok(w.fetch_with_request(req))
    } else {
        Err(JsValue::from_str("no fetch in this context"))
    }
}

/// How long a request waits for its response (status and headers); its body then has this
/// plus its bytes at [`MIN_RATE`] before the request is aborted and tried again, so that a
/// server that stops mid-body cannot hang the page (as the native client's deadline).
static RESPONSE_TIMEOUT_MS: AtomicU32 = AtomicU32::new(30_000);

/// The slowest transfer rate a body may take (bytes/s), as the native client's default.
const MIN_RATE: u64 = 1 << 20;

/// A side file read whole without a `Content-Length` is given the deadline of this many bytes.
const SIDE_FILE_BYTES: u64 = 16 << 20;

/// Sets the response timeout of every later request (at least 1 ms).
pub fn set_response_timeout_ms(ms: u32) {
    RESPONSE_TIMEOUT_MS.store(ms.max(1), Ordering::Relaxed);
}

/// The response timeout now.
pub fn response_timeout_ms() -> u32 {
    RESPONSE_TIMEOUT_MS.load(Ordering::Relaxed)
}

/// `setTimeout(f, ms)` on the window or the worker; the handle for [`clear_timer`].
fn set_timer(f: &js_sys::Function, ms: i32) -> Option<i32> {
    let global = js_sys::global();
    if let Some(w) = global.dyn_ref::<web_sys::Window>() {
        w.set_timeout_with_callback_and_timeout_and_arguments_0(f, ms)
            .ok()
    } else if let Some(w) = global.dyn_ref::<web_sys::WorkerGlobalScope>() {
        w.set_timeout_with_callback_and_timeout_and_arguments_0(f, ms)
            .ok()
    } else {
        None
    }
}

fn clear_timer(handle: i32) {
    let global = js_sys::global();
    if let Some(w) = global.dyn_ref::<web_sys::Window>() {
        w.clear_timeout_with_handle(handle);
    } else if let Some(w) = global.dyn_ref::<web_sys::WorkerGlobalScope>() {
        w.clear_timeout_with_handle(handle);
    }
}

/// Waits `ms` milliseconds on the event loop.
pub async fn sleep_ms(ms: i32) {
    let p = js_sys::Promise::new(&mut |resolve, _| {
        set_timer(&resolve, ms);
    });
    let _ = JsFuture::from(p).await;
}

enum Attempt {
    /// The response, and its body when the status is 2xx.
    Done(web_sys::Response, Option<js_sys::Uint8Array>),
    /// Worth another try (network error, 5xx, 408, 429).
    Retry(String),
    Fail(String),
}

/// Calls `abort` after `ms`; the handle for [`clear_timer`].
fn abort_after(abort: &web_sys::AbortController, ms: u64) -> Option<i32> {
    let on_timeout = {
        let abort = abort.clone();
        Closure::once_into_js(move || abort.abort())
    };
    set_timer(on_timeout.unchecked_ref(), ms.min(i32::MAX as u64) as i32)
}

async fn attempt(url: &str, range: Option<(u64, u64)>, limit: u64) -> Attempt {
    let init = web_sys::RequestInit::new();
    init.set_method("GET");
    init.set_cache(web_sys::RequestCache::NoStore);
    if let Some((a, b)) = range {
        let headers = match web_sys::Headers::new() {
            Ok(h) => h,
            Err(e) => return Attempt::Fail(js_msg(&e)),
        };
        if let Err(e) = headers.set("Range", &format!("bytes={a}-{b}")) {
            return Attempt::Fail(js_msg(&e));
        }
        init.set_headers(&headers);
    }
    // No response within the timeout, or no whole body within the timeout plus its bytes at
    // MIN_RATE: abort, and try again.
    let abort = match web_sys::AbortController::new() {
        Ok(c) => c,
        Err(e) => return Attempt::Fail(js_msg(&e)),
    };
    init.set_signal(Some(&abort.signal()));
    let req = match web_sys::Request::new_with_str_and_init(url, &init) {
        Ok(r) => r,
        Err(e) => return Attempt::Fail(js_msg(&e)),
    };
    let promise = match global_fetch(&req) {
        Ok(p) => p,
        Err(e) => return Attempt::Fail(js_msg(&e)),
    };
    let response_ms = response_timeout_ms() as u64;
    let timer = abort_after(&abort, response_ms);
    let v = JsFuture::from(promise).await;
    if let Some(t) = timer {
        clear_timer(t);
    }
    if v.is_err() && abort.signal().aborted() {
        return Attempt::Retry(format!("no response within {response_ms} ms"));
    }
    let r = match v {
        Ok(v) => match v.dyn_into::<web_sys::Response>() {
            Ok(r) => r,
            Err(_) => return Attempt::Fail("fetch did not return a Response".into()),
        },
        Err(e) => return Attempt::Retry(format!("network error: {}", js_msg(&e))),
    };
    if r.status() >= 500 || r.status() == 408 || r.status() == 429 {
        return Attempt::Retry(format!("HTTP {}", r.status()));
    }
    // The body is read only where it is the answer asked for: a 206 to a range request (the
    // caller reports anything else, a server ignoring Range included, without downloading a
    // whole file), a 2xx of at most `limit` bytes to a plain GET.
    let wanted = match range {
        Some(_) => r.status() == 206,
        None => (200..300).contains(&r.status()),
    };
    if !wanted {
        return Attempt::Done(r, None);
    }
    let length: Option<u64> = header(&r, "content-length").and_then(|v| v.parse().ok());
    if range.is_none() && length.is_some_and(|n| n > limit) {
        return Attempt::Fail(format!(
            "{} bytes, more than the {limit} allowed for a side file",
            length.unwrap_or(0)
        ));
    }
    let body_bytes = range
        .map(|(a, b)| b + 1 - a)
        .unwrap_or_else(|| length.unwrap_or(SIDE_FILE_BYTES).min(limit));
    let body_ms = response_ms + body_bytes.saturating_mul(1000) / MIN_RATE;
    let p = match r.array_buffer() {
        Ok(p) => p,
        Err(e) => return Attempt::Fail(format!("reading the body: {}", js_msg(&e))),
    };
    let timer = abort_after(&abort, body_ms);
    let body = JsFuture::from(p).await;
    if let Some(t) = timer {
        clear_timer(t);
    }
    match body {
        Ok(ab) => Attempt::Done(r, Some(js_sys::Uint8Array::new(&ab))),
        Err(_) if abort.signal().aborted() => {
            Attempt::Retry(format!("the body did not arrive within {body_ms} ms"))
        }
        Err(e) => Attempt::Retry(format!("reading the body: {}", js_msg(&e))),
    }
}

const ATTEMPTS: u32 = 4;

async fn fetch_with_retries(
    url: &str,
    range: Option<(u64, u64)>,
    limit: u64,
) -> Result<(web_sys::Response, Option<js_sys::Uint8Array>)> {
    let mut last = String::new();
    for k in 0..ATTEMPTS {
        if k > 0 {
            sleep_ms(100 << (2 * (k - 1))).await;
        }
        match attempt(url, range, limit).await {
            Attempt::Done(r, body) => return Ok((r, body)),
            Attempt::Retry(m) => last = m,
            Attempt::Fail(m) => return Err(http_err(url, m)),
        }
    }
    Err(http_err(
        url,
        format!("gave up after {ATTEMPTS} attempts: {last}"),
    ))
}

fn body(url: &str, data: Option<js_sys::Uint8Array>) -> Result<js_sys::Uint8Array> {
    data.ok_or_else(|| http_err(url, "a 2xx response without a body".into()))
}

fn header(r: &web_sys::Response, name: &str) -> Option<String> {
    r.headers().get(name).ok().flatten()
}

/// The bytes `offset .. offset + len` of `url` and the file's total length, by one Range
/// request whose answer must be exactly that range.
pub async fn fetch_range(
    traffic: &SharedTraffic,
    url: &str,
    offset: u64,
    len: u64,
    purpose: &'static str,
) -> Result<(js_sys::Uint8Array, u64)> {
    range_request(traffic, url, offset, len, purpose, false)
        .await?
        .ok_or_else(|| http_err(url, "HTTP 404".into()))
}

/// [`fetch_range`], with `None` for a 404 where `absent_ok` (opening a file that may not exist).
async fn range_request(
    traffic: &SharedTraffic,
    url: &str,
    offset: u64,
    len: u64,
    purpose: &'static str,
    absent_ok: bool,
) -> Result<Option<(js_sys::Uint8Array, u64)>> {
    if len == 0 {
        return Err(http_err(url, format!("empty read at offset {offset}")));
    }
    let want = (offset, offset + len - 1);
    let resp = fetch_with_retries(url, Some(want), u64::MAX).await;
    let log = |status: u16, bytes: u64| {
        if let Ok(mut t) = traffic.lock() {
            t.requests.push(RequestLog {
                url: url.to_string(),
                range: Some(want),
                status,
                bytes,
                purpose,
            });
        }
    };
    let (resp, data) = match resp {
        Ok(r) => r,
        Err(e) => {
            log(0, 0);
            return Err(e);
        }
    };
    let status = resp.status();
    if status == 404 && absent_ok {
        log(status, 0);
        return Ok(None);
    }
    if status != 206 {
        log(status, 0);
        return Err(http_err(
            url,
            format!(
                "asked for bytes {}-{} and got HTTP {status}{}: the server must answer Range requests with 206",
                want.0,
                want.1,
                if status == 200 { " (it ignored the Range header)" } else { "" }
            ),
        ));
    }
    let cr = header(&resp, "content-range").unwrap_or_default();
    let total = match parse_content_range(&cr) {
        Some((a, b, total)) if (a, b) == want => total,
        _ => {
            log(status, 0);
            return Err(http_err(
                url,
                format!(
                    "asked for bytes {}-{}, the answer's Content-Range is '{cr}'",
                    want.0, want.1
                ),
            ));
        }
    };
    // A validator that disappears is a change too: the bytes may be another file's.
    let validator = header(&resp, "etag").or_else(|| header(&resp, "last-modified"));
    if let Ok(mut t) = traffic.lock() {
        match (t.validators.get(url), validator) {
            (Some(prev), v) if v.as_ref() != Some(prev) => {
                return Err(http_err(
                    url,
                    format!(
                        "the file changed during the run (ETag/Last-Modified '{prev}' became '{}')",
                        v.unwrap_or_default()
                    ),
                ))
            }
            (None, Some(v)) => {
                t.validators.insert(url.to_string(), v);
            }
            _ => {}
        }
    }
    let data = body(url, data)?;
    let got = data.length() as u64;
    log(status, got);
    if got != len {
        return Err(http_err(
            url,
            format!("short read at offset {offset}: wanted {len} bytes, got {got}"),
        ));
    }
    let total = total.unwrap_or(offset + len);
    Ok(Some((data, total)))
}

/// A small side file (config.json) by a plain GET; `None` on 404.
pub async fn fetch_small(
    traffic: &SharedTraffic,
    url: &str,
    limit: u64,
) -> Result<Option<Vec<u8>>> {
    let (resp, data) = fetch_with_retries(url, None, limit).await?;
    let status = resp.status();
    if status == 404 {
        if let Ok(mut t) = traffic.lock() {
            t.requests.push(RequestLog {
                url: url.to_string(),
                range: None,
                status,
                bytes: 0,
                purpose: "side-file",
            });
        }
        return Ok(None);
    }
    if !(200..300).contains(&status) {
        return Err(http_err(url, format!("HTTP {status}")));
    }
    let data = body(url, data)?;
    if let Ok(mut t) = traffic.lock() {
        t.requests.push(RequestLog {
            url: url.to_string(),
            range: None,
            status,
            bytes: data.length() as u64,
            purpose: "side-file",
        });
    }
    if data.length() as u64 > limit {
        return Err(http_err(
            url,
            format!(
                "{} bytes, more than the {limit} allowed for a side file",
                data.length()
            ),
        ));
    }
    Ok(Some(data.to_vec()))
}

#[derive(Default)]
struct Pending {
    done: VecDeque<ReadCompletion>,
    waker: Option<Waker>,
    in_flight: usize,
    busy: Duration,
    busy_since: Option<Instant>,
}

/// The browser's [`ByteSource`]: each read is a `fetch` Range request whose body is copied into
/// the ring slot it was submitted with; completions wake the executor's await.
pub struct FetchSource {
    files: Vec<SourceFile>,
    urls: Vec<String>,
    pending: Arc<Mutex<Pending>>,
    traffic: SharedTraffic,
}

impl FetchSource {
    /// A source over `urls` (one per file, lengths in `files`).
    pub fn new(files: Vec<SourceFile>, urls: Vec<String>, traffic: SharedTraffic) -> Self {
        FetchSource {
            files,
            urls,
            pending: Arc::default(),
            traffic,
        }
    }

    /// The source factory the executor asks for (one source for the resident pass, one for the
    /// stream) over `model`'s files.
    pub fn maker(
        model: &ModelIndex,
        traffic: &SharedTraffic,
    ) -> impl FnMut() -> Box<dyn ByteSource> {
        let files = model.source().files().to_vec();
        let urls: Vec<String> = files.iter().map(|f| f.name.clone()).collect();
        let traffic = traffic.clone();
        move || {
            Box::new(FetchSource::new(
                files.clone(),
                urls.clone(),
                traffic.clone(),
            ))
        }
    }
}

impl ByteSource for FetchSource {
    fn files(&self) -> &[SourceFile] {
        &self.files
    }

    fn submit(&mut self, req: ReadRequest) -> Result<()> {
        check_range(&self.files, req.file, req.offset, req.len as u64, &req.what)?;
        if req.len > req.slot.bytes().len() {
            return Err(Error::Invalid(format!(
                "read of {} bytes does not fit a ring slot of {} bytes",
                req.len,
                req.slot.bytes().len()
            )));
        }
        let url = self.urls[req.file].clone();
        let (pending, traffic) = (self.pending.clone(), self.traffic.clone());
        if let Ok(mut p) = pending.lock() {
            if p.in_flight == 0 {
                p.busy_since = Some(Instant::now());
            }
            p.in_flight += 1;
        }
        wasm_bindgen_futures::spawn_local(async move {
            let ReadRequest {
                tag,
                offset,
                len,
                mut slot,
                what,
                ..
            } = req;
            let t = Instant::now();
            let result = match fetch_range(&traffic, &url, offset, len as u64, "weights").await {
                Ok((data, _)) => {
                    data.copy_to(&mut slot.bytes_mut()[..len]);
                    Ok(())
                }
                Err(e) => Err(Error::Model {
                    file: url.clone(),
                    msg: format!("tensor '{what}' at offset {offset}: {e}"),
                }),
            };
            if let Ok(mut p) = pending.lock() {
                p.done.push_back(ReadCompletion {
                    tag,
                    slot,
                    result,
                    elapsed: t.elapsed(),
                    held: None,
                });
                if let Some(w) = p.waker.take() {
                    w.wake();
                }
            }
        });
        Ok(())
    }

    fn poll_completion(&mut self) -> Option<ReadCompletion> {
        let mut p = self.pending.lock().ok()?;
        let c = p.done.pop_front()?;
        p.in_flight -= 1;
        if p.in_flight == 0 {
            if let Some(s) = p.busy_since.take() {
                p.busy += s.elapsed();
            }
        }
        Some(c)
    }

    /// Never blocks: the browser delivers completions only between turns of its event loop,
    /// which the executor's async path awaits.
    fn wait_completion(&mut self) -> Option<ReadCompletion> {
        self.poll_completion()
    }

    fn in_flight(&self) -> usize {
        self.pending.lock().map(|p| p.in_flight).unwrap_or(0)
    }

    fn busy_time(&self) -> Duration {
        self.pending
            .lock()
            .map(|p| p.busy + p.busy_since.map(|s| s.elapsed()).unwrap_or_default())
            .unwrap_or_default()
    }

    fn register_waker(&self, waker: &Waker) {
        if let Ok(mut p) = self.pending.lock() {
            p.waker = Some(waker.clone());
        }
    }
}

/// A model folder at a URL, read with `fetch`: the browser's side of core's one open routine
/// ([`nibble_core::io::model::open_model`]). Weights then stream through [`FetchSource`]; nothing
/// in the browser reads them synchronously.
pub struct FetchFolder {
    base: String,
    traffic: SharedTraffic,
    opened: Mutex<Vec<SourceFile>>,
}

impl FetchFolder {
    /// The folder at `base`.
    pub fn new(base: &str, traffic: SharedTraffic) -> Self {
        FetchFolder {
            base: base.trim_end_matches('/').to_string(),
            traffic,
            opened: Mutex::new(Vec::new()),
        }
    }
}

impl ModelFolder for FetchFolder {
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
        Box::pin(async move { fetch_small(&self.traffic, &self.locate(name), limit).await })
    }

    fn open_file<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<OpenedFile>>> {
        Box::pin(async move {
            let url = self.locate(name);
            let Some((head, len)) =
                range_request(&self.traffic, &url, 0, 8, "header", true).await?
            else {
                return Ok(None);
            };
            let mut opened = self
                .opened
                .lock()
                .map_err(|_| Error::Invalid("folder poisoned".into()))?;
            opened.push(SourceFile { name: url, len });
            Ok(Some(OpenedFile {
                index: opened.len() - 1,
                len,
                head: head.to_vec(),
            }))
        })
    }

    fn read_at<'a>(
        &'a self,
        file: usize,
        offset: u64,
        len: u64,
        what: &'a str,
    ) -> BoxFuture<'a, Result<Vec<u8>>> {
        Box::pin(async move {
            let url = self
                .opened
                .lock()
                .map_err(|_| Error::Invalid("folder poisoned".into()))?
                .get(file)
                .map(|f| f.name.clone())
                .ok_or_else(|| Error::Invalid(format!("no opened file #{file}")))?;
            let purpose = if what == "<header>" {
                "header"
            } else {
                "quant-state"
            };
            Ok(fetch_range(&self.traffic, &url, offset, len, purpose)
                .await?
                .0
                .to_vec())
        })
    }

    fn list_safetensors(&self) -> Result<Option<Vec<String>>> {
        Ok(None)
    }

    fn source(&self) -> Result<Arc<dyn RangeSource>> {
        let files = self
            .opened
            .lock()
            .map_err(|_| Error::Invalid("folder poisoned".into()))?
            .clone();
        Ok(Arc::new(StreamOnly { files }))
    }

    fn missing(&self, name: &str) -> Error {
        http_err(&self.locate(name), "HTTP 404 (not found)".into())
    }
}

/// The browser's files as a [`RangeSource`]: their names and lengths for the planner; reads
/// go through [`FetchSource`] (a synchronous read would block the page).
struct StreamOnly {
    files: Vec<SourceFile>,
}

impl RangeSource for StreamOnly {
    fn files(&self) -> &[SourceFile] {
        &self.files
    }

    fn read_exact_at(&self, file: usize, offset: u64, _buf: &mut [u8], what: &str) -> Result<()> {
        Err(Error::Model {
            file: self
                .files
                .get(file)
                .map(|f| f.name.clone())
                .unwrap_or_default(),
            msg: format!(
                "tensor '{what}' at offset {offset}: in the browser weights are only streamed, \
                 not read synchronously"
            ),
        })
    }
}
