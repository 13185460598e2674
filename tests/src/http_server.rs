//! A small, deliberately misbehaving HTTP/1.1 file server for tests, on 127.0.0.1 only. It
//! serves in-memory files with byte ranges and keep-alive, and can be told to fail in the ways
//! real servers and networks do.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// How the server misbehaves.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// Behave.
    None,
    /// Answer 200 with the whole file to ranged requests.
    IgnoreRange,
    /// Answer 206 with a Content-Range that is off by one.
    WrongContentRange,
    /// On the first `n` ranged requests of at least 1 KiB, send half the body and close cleanly
    /// (Content-Length promises all of it).
    ShortBody(usize),
    /// On the first `n` ranged requests of at least 1 KiB, send half the body and reset.
    ResetMidBody(usize),
    /// Answer the first `n` requests with 500.
    ServerErrors(usize),
    /// Answer every request with this status.
    Status(u16),
    /// Change the ETag after `n` requests.
    EtagChangesAfter(usize),
    /// Send no ETag after `n` requests (a validator that vanishes).
    EtagVanishesAfter(usize),
    /// Send headers and half of every body of 2 bytes or more (none of a range that does not
    /// start at 0: a resumed read), then keep the connection open and silent for a minute.
    StallMidBody,
    /// Send headers and the first byte of every body of 2 bytes or more (a resumed read's
    /// too), then keep the connection open and silent for a minute: each request progresses.
    Trickle,
    /// Answer ranges with a Content-Range that gives no total (`bytes a-b/*`).
    NoTotal,
    /// Answer ranges with a Content-Range whose total is not the file's length.
    WrongTotal,
}

/// What the server saw.
#[derive(Debug, Default, Clone)]
pub struct Stats {
    /// Requests received.
    pub requests: usize,
    /// Body bytes sent.
    pub body_bytes: u64,
    /// Body bytes sent per path.
    pub bytes_by_path: HashMap<String, u64>,
    /// Requests without a Range header.
    pub full_gets: usize,
    /// The ranges asked for (path, start, end inclusive).
    pub ranges: Vec<(String, u64, u64)>,
}

/// A running server; stops when dropped.
pub struct TestServer {
    /// `http://127.0.0.1:PORT`.
    pub base: String,
    stats: Arc<Mutex<Stats>>,
    fault: Arc<Mutex<Fault>>,
    stop: Arc<AtomicBool>,
    port: u16,
}

impl TestServer {
    /// Starts serving `files` (path without leading slash -> bytes).
    pub fn start(files: HashMap<String, Vec<u8>>, fault: Fault) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1");
        let port = listener.local_addr().expect("addr").port();
        let stats = Arc::new(Mutex::new(Stats::default()));
        let fault = Arc::new(Mutex::new(fault));
        let stop = Arc::new(AtomicBool::new(false));
        let files = Arc::new(files);
        let (s, f, st) = (stats.clone(), fault.clone(), stop.clone());
        std::thread::spawn(move || {
            for conn in listener.incoming() {
                if st.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(conn) = conn else { continue };
                let (files, s, f) = (files.clone(), s.clone(), f.clone());
                std::thread::spawn(move || serve_conn(conn, &files, &s, &f));
            }
        });
        TestServer {
            base: format!("http://127.0.0.1:{port}"),
            stats,
            fault,
            stop,
            port,
        }
    }

    /// A snapshot of what the server saw.
    pub fn stats(&self) -> Stats {
        self.stats.lock().expect("stats").clone()
    }

    /// Changes the fault from now on.
    pub fn set_fault(&self, fault: Fault) {
        *self.fault.lock().expect("fault") = fault;
    }
}

impl Drop for TestServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        let _ = TcpStream::connect(("127.0.0.1", self.port));
    }
}

fn serve_conn(
    conn: TcpStream,
    files: &HashMap<String, Vec<u8>>,
    stats: &Mutex<Stats>,
    fault: &Mutex<Fault>,
) {
    let mut reader = BufReader::new(conn.try_clone().expect("clone"));
    let mut out = conn;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line
            .split_whitespace()
            .nth(1)
            .unwrap_or("/")
            .trim_start_matches('/')
            .to_string();
        let mut range: Option<(u64, Option<u64>)> = None;
        loop {
            let mut h = String::new();
            if reader.read_line(&mut h).unwrap_or(0) == 0 {
                return;
            }
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("range") {
                    let v = v.trim().trim_start_matches("bytes=");
                    if let Some((a, b)) = v.split_once('-') {
                        range = a.parse().ok().map(|a| (a, b.parse().ok()));
                    }
                }
            }
        }
        let n = {
            let mut s = stats.lock().expect("stats");
            s.requests += 1;
            if range.is_none() {
                s.full_gets += 1;
            }
            s.requests
        };
        let fault_now = fault.lock().expect("fault").clone();
        let etag_header = match fault_now {
            Fault::EtagChangesAfter(k) if n > k => "ETag: \"v2\"\r\n",
            Fault::EtagVanishesAfter(k) if n > k => "",
            _ => "ETag: \"v1\"\r\n",
        };
        let status_only = |out: &mut TcpStream, code: u16| {
            let _ = write!(
                out,
                "HTTP/1.1 {code} X\r\nContent-Length: 0\r\n{etag_header}\r\n"
            );
        };
        match fault_now {
            Fault::ServerErrors(k) if n <= k => {
                status_only(&mut out, 500);
                continue;
            }
            Fault::Status(code) => {
                status_only(&mut out, code);
                continue;
            }
            _ => {}
        }
        let Some(data) = files.get(&path) else {
            status_only(&mut out, 404);
            continue;
        };
        let len = data.len() as u64;
        let resumed = range.is_some_and(|(a, _)| a > 0);
        let send = |out: &mut TcpStream, head: String, body: &[u8]| -> bool {
            if matches!(fault_now, Fault::StallMidBody | Fault::Trickle) && body.len() >= 2 {
                let _ = out.write_all(head.as_bytes());
                if fault_now == Fault::Trickle {
                    let _ = out.write_all(&body[..1]);
                } else if !resumed {
                    let _ = out.write_all(&body[..body.len() / 2]);
                }
                let _ = out.flush();
                std::thread::sleep(std::time::Duration::from_secs(60));
                return false;
            }
            // Counted before it is sent (as before, whether or not the write succeeds): counted
            // after, a client that has read the whole body could look at the stats first.
            {
                let mut s = stats.lock().expect("stats");
                s.body_bytes += body.len() as u64;
                *s.bytes_by_path.entry(path.clone()).or_default() += body.len() as u64;
            }
            out.write_all(head.as_bytes()).is_ok() && out.write_all(body).is_ok()
        };
        match range {
            Some((a, b)) if fault_now != Fault::IgnoreRange => {
                let b = b
                    .unwrap_or(len.saturating_sub(1))
                    .min(len.saturating_sub(1));
                if a >= len || b < a {
                    let _ = write!(out, "HTTP/1.1 416 Range Not Satisfiable\r\nContent-Range: bytes */{len}\r\nContent-Length: 0\r\n\r\n");
                    continue;
                }
                stats
                    .lock()
                    .expect("stats")
                    .ranges
                    .push((path.clone(), a, b));
                let body = &data[a as usize..=b as usize];
                let cr = match fault_now {
                    Fault::WrongContentRange => format!("bytes {}-{}/{len}", a + 1, b),
                    Fault::NoTotal => format!("bytes {a}-{b}/*"),
                    Fault::WrongTotal => format!("bytes {a}-{b}/{}", len + 4096),
                    _ => format!("bytes {a}-{b}/{len}"),
                };
                let head = format!(
                    "HTTP/1.1 206 Partial Content\r\nContent-Range: {cr}\r\nContent-Length: {}\r\n{etag_header}Accept-Ranges: bytes\r\n\r\n",
                    body.len()
                );
                let cut = match fault_now {
                    Fault::ShortBody(k) | Fault::ResetMidBody(k) if body.len() >= 1024 && k > 0 => {
                        let mut f = fault.lock().expect("fault");
                        *f = match fault_now {
                            Fault::ShortBody(_) => Fault::ShortBody(k - 1),
                            _ => Fault::ResetMidBody(k - 1),
                        };
                        Some(body.len() / 2)
                    }
                    _ => None,
                };
                if let Some(c) = cut {
                    send(&mut out, head, &body[..c]);
                    let _ = out.flush();
                    // A short body ends with FIN (the data arrives, then EOF); a reset sends RST,
                    // which also discards what the client had not read yet.
                    let how = if matches!(fault_now, Fault::ShortBody(_)) {
                        std::net::Shutdown::Write
                    } else {
                        std::net::Shutdown::Both
                    };
                    let _ = out.shutdown(how);
                    return;
                }
                if !send(&mut out, head, body) {
                    return;
                }
            }
            _ => {
                let head = format!("HTTP/1.1 200 OK\r\nContent-Length: {len}\r\n{etag_header}\r\n");
                if !send(&mut out, head, data) {
                    return;
                }
            }
        }
    }
}

/// Every file below `root`, keyed `prefix/relative/path` (what [`TestServer::start`] serves).
pub fn files_under(root: &std::path::Path, prefix: &str) -> HashMap<String, Vec<u8>> {
    fn walk(
        root: &std::path::Path,
        at: &std::path::Path,
        prefix: &str,
        files: &mut HashMap<String, Vec<u8>>,
    ) {
        for e in std::fs::read_dir(at).expect("dir") {
            let p = e.expect("entry").path();
            if p.is_dir() {
                walk(root, &p, prefix, files);
            } else {
                let rel = p.strip_prefix(root).expect("rel").display().to_string();
                files.insert(format!("{prefix}/{rel}"), std::fs::read(&p).expect("read"));
            }
        }
    }
    let mut files = HashMap::new();
    walk(root, root, prefix, &mut files);
    files
}
