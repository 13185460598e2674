//! A server the tests start as a child process (`nibble serve`): the address it prints, and the
//! process killed and reaped when the test lets go of it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};

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
        Served { child, addr }
    }
}

impl Drop for Served {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
