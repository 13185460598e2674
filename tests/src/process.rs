//! A server the tests start as a child process (`nibble serve`): the address it prints, and the
//! process killed and reaped when the test lets go of it, or when the test binary exits while it
//! still holds it (a server kept in a `static` is never dropped).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use serde_json::Value;
use std::process::{Child, Command, Stdio};
use std::sync::{Mutex, Once};

/// Pids of servers not dropped yet; killed by [`kill_live`] when the test binary exits.
static LIVE: Mutex<Vec<u32>> = Mutex::new(Vec::new());

extern "C" fn kill_live() {
    let live = LIVE.lock().unwrap_or_else(|e| e.into_inner());
    for &pid in live.iter() {
        // SAFETY: kill(2) on a pid this process spawned and has not reaped (Drop removes the pid
        // before it waits), so the pid cannot have been reused.
        unsafe {
            libc::kill(pid as libc::pid_t, libc::SIGKILL);
        }
    }
}

fn register(pid: u32) {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        // SAFETY: registers a plain extern "C" function with no captured state; the C runtime
        // calls it from exit(), which the test harness reaches when main returns or exits.
        unsafe {
            libc::atexit(kill_live);
        }
    });
    LIVE.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
}

/// A running server; killed when dropped.
pub struct Served {
    /// The process.
    pub child: Child,
    /// `IP:PORT` from its first line that says `... http://IP:PORT/...`.
    pub addr: String,
}

impl Served {
    /// `nibble serve --model MODEL` (the binary `nibble`) on a free loopback port with the CPU
    /// backend and `extra` options, its log discarded.
    pub fn api(nibble: &str, model: &std::path::Path, extra: &[&str]) -> Served {
        let mut cmd = Command::new(nibble);
        cmd.args(["serve", "--model"])
            .arg(model)
            .args(["--addr", "127.0.0.1:0", "--backend", "cpu"])
            .args(extra)
            .stderr(Stdio::null());
        Served::start(cmd)
    }

    /// Starts `cmd` with its stdout piped, waits for the line with its address, and keeps
    /// reading its output so that it never blocks on a full pipe.
    pub fn start(mut cmd: Command) -> Served {
        let mut child = cmd
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the server");
        let mut lines = BufReader::new(child.stdout.take().expect("stdout")).lines();
        let addr = loop {
            let line = lines
                .next()
                .expect("the server printed its address")
                .expect("stdout");
            if let Some(rest) = line.split("http://").nth(1) {
                break rest.split('/').next().expect("address").to_string();
            }
        };
        std::thread::spawn(move || for _ in lines {});
        register(child.id());
        Served { child, addr }
    }
}

/// An HTTP client for the tests of the API server: one request a connection.
impl Served {
    /// (status, headers, body) of one request.
    pub fn request(
        &self,
        method: &str,
        path: &str,
        headers: &[(&str, &str)],
        body: &[u8],
    ) -> (u16, String, Vec<u8>) {
        let mut s = TcpStream::connect(&self.addr).expect("connect");
        s.set_read_timeout(Some(Duration::from_secs(300)))
            .expect("timeout");
        let mut req = format!(
            "{method} {path} HTTP/1.1\r\nHost: {}\r\nConnection: close\r\nContent-Length: {}\r\n",
            self.addr,
            body.len()
        );
        for (k, v) in headers {
            req.push_str(&format!("{k}: {v}\r\n"));
        }
        req.push_str("\r\n");
        s.write_all(req.as_bytes()).expect("write");
        // A server that refuses a body (413) may answer and close before it is all sent.
        let _ = s.write_all(body);
        let mut raw = Vec::new();
        if let Err(e) = s.read_to_end(&mut raw) {
            assert!(!raw.is_empty(), "read: {e}");
        }
        let split = raw
            .windows(4)
            .position(|w| w == b"\r\n\r\n")
            .expect("a response head");
        let head = String::from_utf8_lossy(&raw[..split]).to_string();
        let status = head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .expect("status");
        (status, head, raw[split + 4..].to_vec())
    }

    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let (status, _, b) = self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        );
        (status, serde_json::from_slice(&b).unwrap_or(Value::Null))
    }

    /// The `data:` events of a streamed response (the chunked framing's size lines skipped).
    pub fn stream(&self, path: &str, body: &Value) -> Vec<String> {
        let (status, _, b) = self.request(
            "POST",
            path,
            &[("Content-Type", "application/json")],
            body.to_string().as_bytes(),
        );
        assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
        String::from_utf8_lossy(&b)
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }

    pub fn metric(&self, name: &str) -> f64 {
        let (_, _, b) = self.request("GET", "/metrics", &[], b"");
        String::from_utf8_lossy(&b)
            .lines()
            .find_map(|l| {
                l.strip_prefix(&format!("nibble_{name} "))
                    .map(str::to_string)
            })
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("no metric {name}"))
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let pid = self.child.id();
        LIVE.lock()
            .unwrap_or_else(|e| e.into_inner())
            .retain(|&p| p != pid);
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
