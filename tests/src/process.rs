//! A server the tests start as a child process (`nibble serve`): the address it prints, and the
//! process killed and reaped when the test lets go of it, or when the test binary exits while it
//! still holds it (a server kept in a `static` is never dropped).

use std::io::{BufRead, BufReader};
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
