//! `nibble serve`: byte ranges, validators, CORS, and nothing outside the folder.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::process::{Command, Stdio};

use nibble_tests::process::Served as Server;

fn start(dir: &std::path::Path) -> Server {
    start_with(dir, &[])
}

fn start_with(dir: &std::path::Path, extra: &[&str]) -> Server {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_nibble"));
    cmd.args([
        "serve",
        dir.to_str().expect("utf8"),
        "--addr",
        "127.0.0.1:0",
    ])
    .args(extra)
    .stderr(Stdio::inherit());
    let s = Server::start(cmd);
    assert!(s.addr.starts_with("127.0.0.1:"), "{}", s.addr);
    s
}

/// Sends a raw request (no client-side path normalisation) and returns status and body.
fn raw(addr: &str, path: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut bytes = Vec::new();
    let _ = s.read_to_end(&mut bytes);
    let resp = String::from_utf8_lossy(&bytes).into_owned();
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, resp)
}

fn fixture() -> (tempfile::TempDir, tempfile::TempDir) {
    let root = tempfile::tempdir().expect("tmp");
    let outside = tempfile::tempdir().expect("tmp");
    std::fs::write(
        root.path().join("data.bin"),
        (0..=255u8).cycle().take(10_000).collect::<Vec<_>>(),
    )
    .expect("w");
    std::fs::create_dir(root.path().join("sub")).expect("mkdir");
    std::fs::write(root.path().join("sub/inner.txt"), b"inner").expect("w");
    std::fs::write(outside.path().join("secret.txt"), b"TOP-SECRET").expect("w");
    std::os::unix::fs::symlink(
        outside.path().join("secret.txt"),
        root.path().join("link.txt"),
    )
    .expect("symlink");
    std::os::unix::fs::symlink(outside.path(), root.path().join("linkdir")).expect("symlink");
    (root, outside)
}

#[test]
fn ranges_validators_and_cors() {
    let (root, _outside) = fixture();
    let srv = start(root.path());
    let agent: ureq::Agent = ureq::Agent::config_builder()
        .http_status_as_error(false)
        .build()
        .into();
    let url = format!("http://{}/data.bin", srv.addr);
    let r = agent
        .get(&url)
        .header("Range", "bytes=100-199")
        .header("Origin", "http://example.invalid")
        .call()
        .expect("GET");
    assert_eq!(r.status().as_u16(), 206);
    let h = |n: &str| {
        r.headers()
            .get(n)
            .and_then(|v| v.to_str().ok())
            .map(str::to_string)
    };
    assert_eq!(h("content-range").as_deref(), Some("bytes 100-199/10000"));
    assert_eq!(h("accept-ranges").as_deref(), Some("bytes"));
    assert!(h("etag").is_some_and(|e| e.starts_with('"')), "strong ETag");
    assert!(h("last-modified").is_some());
    assert_eq!(h("access-control-allow-origin").as_deref(), Some("*"));
    let exposed = h("access-control-expose-headers")
        .unwrap_or_default()
        .to_ascii_lowercase();
    assert!(
        exposed.contains("content-range") && exposed.contains("etag"),
        "{exposed}"
    );
    let body = r.into_body().read_to_vec().expect("body");
    assert_eq!(
        body,
        (100..200).map(|i| (i % 256) as u8).collect::<Vec<_>>()
    );

    let r = agent
        .get(&url)
        .header("Range", "bytes=20000-")
        .call()
        .expect("GET");
    assert_eq!(r.status().as_u16(), 416, "unsatisfiable range");

    let r = agent
        .get(&format!("http://{}/sub/inner.txt", srv.addr))
        .call()
        .expect("GET");
    assert_eq!(r.status().as_u16(), 200);
    let etag1 = r.headers().get("etag").cloned();
    let r2 = agent
        .get(&format!("http://{}/sub/inner.txt", srv.addr))
        .call()
        .expect("GET");
    assert_eq!(etag1, r2.headers().get("etag").cloned(), "ETag is stable");
}

#[test]
fn nothing_outside_the_folder_is_served() {
    let (root, _outside) = fixture();
    let srv = start(root.path());
    for path in [
        "/../secret.txt",
        "/sub/../../secret.txt",
        "/%2e%2e/secret.txt",
        "/sub/%2E%2E/%2e%2e/etc/passwd",
        "/..%2fsecret.txt",
        "//etc/passwd",
        "/etc/passwd",
        "/link.txt",
        "/linkdir/secret.txt",
    ] {
        let (status, resp) = raw(&srv.addr, path);
        assert!(
            status == 403 || status == 404 || status == 400,
            "{path}: status {status}"
        );
        assert!(
            !resp.contains("TOP-SECRET") && !resp.contains("root:"),
            "{path} leaked: {resp}"
        );
    }
    assert_eq!(raw(&srv.addr, "/data.bin").0, 200);
}

/// `--mount models=DIR` serves a second folder at /models/, ranges included, with the same
/// guard: nothing outside it, nor outside the main folder, leaks through the mount.
#[test]
fn mounted_folders_are_served_and_guarded() {
    let (root, _outside) = fixture();
    let (models, outside2) = fixture();
    let mount = format!("models={}", models.path().display());
    let srv = start_with(root.path(), &["--mount", &mount]);
    let (status, resp) = raw(&srv.addr, "/models/sub/inner.txt");
    assert_eq!(status, 200, "{resp}");
    assert!(resp.ends_with("inner"), "{resp}");
    assert_eq!(
        raw(&srv.addr, "/sub/inner.txt").0,
        200,
        "the main folder still at /"
    );
    let mut s = TcpStream::connect(&srv.addr).expect("connect");
    write!(
        s,
        "GET /models/data.bin HTTP/1.1\r\nHost: x\r\nRange: bytes=10-19\r\nConnection: close\r\n\r\n"
    )
    .expect("send");
    let mut bytes = Vec::new();
    let _ = s.read_to_end(&mut bytes);
    let head = String::from_utf8_lossy(&bytes).to_lowercase();
    assert!(head.starts_with("http/1.1 206"), "{head}");
    assert!(head.contains("content-range: bytes 10-19/10000"), "{head}");
    assert!(
        bytes.ends_with(&(10..20u8).collect::<Vec<_>>()),
        "range body"
    );
    for path in [
        "/models/../../secret.txt",
        "/models/%2e%2e/secret.txt",
        "/models/link.txt",
        "/models/linkdir/secret.txt",
    ] {
        let (status, resp) = raw(&srv.addr, path);
        assert!(
            status == 403 || status == 404 || status == 400,
            "{path}: status {status}"
        );
        assert!(!resp.contains("TOP-SECRET"), "{path} leaked: {resp}");
    }
    drop(outside2);
    let bad = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["serve", ".", "--mount", "../x=/tmp"])
        .output()
        .expect("run");
    assert_eq!(bad.status.code(), Some(1));
    assert!(
        String::from_utf8_lossy(&bad.stderr).contains("NAME must be one path segment"),
        "{}",
        String::from_utf8_lossy(&bad.stderr)
    );
}

#[test]
fn binds_loopback_unless_told_otherwise() {
    let out = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["serve", "--help"])
        .output()
        .expect("help");
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("[default: 127.0.0.1:8080]"), "{text}");
}

/// Sends `request` as it is and returns the status and the whole answer.
fn raw_request(addr: &str, request: &str) -> (u16, String) {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.write_all(request.as_bytes()).expect("send");
    let mut bytes = Vec::new();
    let _ = s.read_to_end(&mut bytes);
    let resp = String::from_utf8_lossy(&bytes).into_owned();
    let status = resp
        .split_whitespace()
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or(0);
    (status, resp)
}

/// Fault class 1: a folder's index file, a FIFO, anything the guard would refuse by name is
/// refused however it is reached.
#[test]
fn index_files_and_special_files_are_guarded_too() {
    let (root, outside) = fixture();
    std::fs::create_dir(root.path().join("site")).expect("mkdir");
    std::os::unix::fs::symlink(
        outside.path().join("secret.txt"),
        root.path().join("site/index.html"),
    )
    .expect("symlink");
    std::fs::create_dir(root.path().join("page")).expect("mkdir");
    std::fs::write(root.path().join("page/index.html"), b"<p>inside</p>").expect("w");
    let ok = Command::new("mkfifo")
        .arg(root.path().join("pipe.bin"))
        .status()
        .expect("mkfifo")
        .success();
    assert!(ok);
    let srv = start(root.path());
    for path in ["/site/", "/site/index.html", "/site", "/pipe.bin"] {
        let (status, resp) = raw(&srv.addr, path);
        assert_eq!(status, 403, "{path}: {resp}");
        assert!(!resp.contains("TOP-SECRET"), "{path} leaked: {resp}");
    }
    let (status, resp) = raw(&srv.addr, "/page/");
    assert_eq!(status, 200, "{resp}");
    assert!(resp.contains("<p>inside</p>"));
}

/// Fault class 21: RFC 9110 If-Range and empty files, no protocol-relative redirect.
#[test]
fn if_range_empty_files_and_redirects_follow_the_rfc() {
    let (root, _outside) = fixture();
    std::fs::write(root.path().join("empty.bin"), b"").expect("w");
    let srv = start(root.path());
    let get = |extra: &str, path: &str| {
        raw_request(
            &srv.addr,
            &format!("GET {path} HTTP/1.1\r\nHost: x\r\n{extra}Connection: close\r\n\r\n"),
        )
    };
    let (_, full) = get("", "/data.bin");
    let etag = full
        .lines()
        .find_map(|l| {
            l.to_ascii_lowercase()
                .starts_with("etag:")
                .then(|| l[5..].trim().to_string())
        })
        .expect("an ETag");
    let (s, r) = get(
        &format!("Range: bytes=0-9\r\nIf-Range: {etag}\r\n"),
        "/data.bin",
    );
    assert_eq!(s, 206, "If-Range with the current ETag: {r}");
    let (s, r) = get("Range: bytes=0-9\r\nIf-Range: \"other\"\r\n", "/data.bin");
    assert_eq!(
        s, 200,
        "If-Range with another ETag gets the whole file: {r}"
    );
    assert!(
        r.to_ascii_lowercase().contains("content-length: 10000"),
        "{r}"
    );
    let (s, _) = get(
        "Range: bytes=0-9\r\nIf-Range: Thu, 01 Jan 1970 00:00:00 GMT\r\n",
        "/data.bin",
    );
    assert_eq!(s, 200, "If-Range with another date");
    let (s, r) = get("Range: bytes=0-\r\n", "/empty.bin");
    assert!(s == 200 || s == 416, "empty file: {r}");
    assert!(!r.contains("bytes 0-0/0"), "{r}");
    for path in ["//sub", "///sub", "//sub?x=1"] {
        let (s, r) = get("", path);
        let location = r
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("location:"))
            .map(|l| l[9..].trim().to_string());
        assert!(
            location
                .as_deref()
                .is_none_or(|l| l.starts_with('/') && !l.starts_with("//")),
            "{path}: {s} {location:?}"
        );
    }
}

/// Fault class 21: a request that never finishes its headers is dropped, and idle sockets
/// cannot stop the service, even under a 64-descriptor limit.
#[test]
fn slow_and_idle_clients_cannot_stop_the_service() {
    let (root, _outside) = fixture();
    let srv = start_with(
        root.path(),
        &["--header-timeout", "2", "--idle-timeout", "2"],
    );
    let mut s = TcpStream::connect(&srv.addr).expect("connect");
    s.write_all(b"GET /data.bin HTTP/1.1\r\nHost: x\r\n")
        .expect("half a request");
    s.set_read_timeout(Some(std::time::Duration::from_secs(15)))
        .expect("timeout");
    let t0 = std::time::Instant::now();
    let mut buf = Vec::new();
    let n = s.read_to_end(&mut buf);
    assert!(
        n.is_ok() && t0.elapsed().as_secs() < 10,
        "a half-sent request was not dropped: {n:?} after {:?}",
        t0.elapsed()
    );

    // The same server started under `ulimit -n 64`, with 80 idle sockets open.
    let bin = env!("CARGO_BIN_EXE_nibble");
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        &format!(
            "ulimit -n 64 && exec '{bin}' serve '{}' --addr 127.0.0.1:0 --header-timeout 2 \
             --idle-timeout 2",
            root.path().display()
        ),
    ]);
    let limited = Server::start(cmd);
    let idle: Vec<TcpStream> = (0..80)
        .filter_map(|_| TcpStream::connect(&limited.addr).ok())
        .collect();
    assert!(idle.len() >= 60, "only {} sockets opened", idle.len());
    let t0 = std::time::Instant::now();
    let (status, _) = raw(&limited.addr, "/sub/inner.txt");
    assert_eq!(status, 200, "served after {:?}", t0.elapsed());
    assert!(t0.elapsed().as_secs() < 20, "took {:?}", t0.elapsed());
    drop(idle);
}

/// #32 fault 9: clients that stop reading hold their connection (and its open file) until the
/// idle timeout; with every slot taken, a stalled one makes room for a waiting client, so a
/// normal request is answered at once, with the default timeouts and under `ulimit -n 64`.
#[test]
fn stalled_readers_make_room_for_new_clients() {
    // Clients that asked for a large file and stopped reading it; then (#32 fault 9) clients
    // that sent half a request and nothing more.
    stalled_clients_make_room(b"GET /big.bin HTTP/1.1\r\nHost: x\r\n\r\n");
    stalled_clients_make_room(b"GET /big.bin HTTP/1.1\r\nHos");
}

/// 80 clients under a 64-descriptor limit that each send `request` and then nothing, held 6 s:
/// a normal GET is still answered within 5 s.
fn stalled_clients_make_room(request: &[u8]) {
    let (root, _outside) = fixture();
    std::fs::write(root.path().join("big.bin"), vec![7u8; 32 << 20]).expect("w");
    let bin = env!("CARGO_BIN_EXE_nibble");
    let mut cmd = Command::new("sh");
    cmd.args([
        "-c",
        &format!(
            "ulimit -n 64 && exec '{bin}' serve '{}' --addr 127.0.0.1:0",
            root.path().display()
        ),
    ]);
    let srv = Server::start(cmd);
    let readers: Vec<TcpStream> = (0..80)
        .filter_map(|_| {
            let mut s = TcpStream::connect(&srv.addr).ok()?;
            s.write_all(request).ok()?;
            Some(s)
        })
        .collect();
    assert!(readers.len() >= 60, "only {} sockets opened", readers.len());
    // Long enough for every served reader's socket buffers to fill and the connection to stall.
    std::thread::sleep(std::time::Duration::from_secs(6));
    let t0 = std::time::Instant::now();
    let (status, body) = raw(&srv.addr, "/sub/inner.txt");
    assert_eq!(status, 200, "{body}");
    assert!(
        t0.elapsed() < std::time::Duration::from_secs(5),
        "answered after {:?} with {} clients holding {:?}",
        t0.elapsed(),
        readers.len(),
        String::from_utf8_lossy(request)
    );
    drop(readers);
}
