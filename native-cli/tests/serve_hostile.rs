//! The API server against hostile and careless clients (#32's server faults):
//! - text out of the server equals the decode of the generated tokens, with SentencePiece's
//!   byte-fallback tokens too, whole and streamed, and the server stays up (faults 1-2);
//! - a client that sends headers and a few body bytes is cut off by the idle timer, one that
//!   trickles its body by `--body-timeout`, and `/health` answers meanwhile (fault 3);
//! - embeddings: at most 2048 inputs, one admission with completions (`--max-batch`,
//!   `--queue`), a request whose client left is dropped (fault 4);
//! - what nibble does not support is refused, not ignored: image parts, `dimensions`, bytes
//!   after the JSON body (fault 6).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use nibble_tests::process::Served;
use serde_json::{json, Value};

fn nibble() -> &'static str {
    env!("CARGO_BIN_EXE_nibble")
}

fn start(model: &Path, extra: &[&str]) -> Served {
    Served::api(nibble(), model, extra)
}

/// A synthetic Llama with a SentencePiece-style tokenizer: 3 specials, the 256 byte-fallback
/// tokens, then words, half of them CJK (`nibble_tests::text::byte_fallback_tokenizer`).
fn byte_fallback_llama(dir: &Path) {
    nibble_tests::synth(Path::new(nibble()), "llama", "2MiB", 3, dir);
    let tok = nibble_tests::text::byte_fallback_tokenizer(4096);
    std::fs::write(dir.join("tokenizer.json"), tok.to_string()).expect("tokenizer.json");
}

#[test]
fn byte_fallback_text_equals_the_decoded_tokens() {
    let dir = tempfile::tempdir().expect("tmp");
    byte_fallback_llama(dir.path());
    let s = start(dir.path(), &["--max-context", "128"]);
    let mut multibyte = 0;
    // Greedy (sampling draws equal, but a random model's near-tied logits may differ in the last
    // bit between the batched and the lone decoder); prompts of the same words in other orders.
    for seed in 0..12u64 {
        let prompt: String = (0..3 + seed % 4)
            .map(|i| if (seed >> i) & 1 == 1 { " a" } else { "b" })
            .collect();
        let out = Command::new(nibble())
            .args(["run", "--model"])
            .arg(dir.path())
            .args([
                "--backend",
                "cpu",
                "--json",
                "--prompt",
                &prompt,
                "--max-tokens",
                "40",
            ])
            .args(["--ignore-eos"])
            .output()
            .expect("nibble run");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let run: Value = serde_json::from_slice(&out.stdout).expect("json");
        let want = run["text"].as_str().expect("text").to_string();
        multibyte += want.chars().filter(|c| c.len_utf8() > 1).count();
        let req = json!({"prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": true});
        let (status, v) = s.post("/v1/completions", &req);
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["choices"][0]["text"], want.as_str(), "{prompt:?}");
        let mut streamed = req.clone();
        streamed["stream"] = json!(true);
        let events = s.stream("/v1/completions", &streamed);
        let text: String = events
            .iter()
            .filter_map(|e| serde_json::from_str::<Value>(e).ok())
            .filter_map(|v| v["choices"][0]["text"].as_str().map(str::to_string))
            .collect();
        assert_eq!(text, want, "streamed: {prompt:?}");
    }
    // The runs went through characters of more than one byte (CJK words, byte tokens).
    assert!(multibyte > 0, "no multi-byte character was generated");
    let (status, _, _) = s.request("GET", "/health", &[], b"");
    assert_eq!(status, 200, "the server is still up");
}

/// Opens a connection and sends a POST's headers for a body of 1000 bytes and `sent` of them.
fn half_sent(addr: &str, sent: usize) -> TcpStream {
    let mut c = TcpStream::connect(addr).expect("connect");
    let head = format!(
        "POST /v1/embeddings HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: 1000\r\n\r\n"
    );
    c.write_all(head.as_bytes()).expect("write");
    c.write_all(&b"{\"input\": \"".repeat(8)[..sent])
        .expect("write");
    c
}

/// Whether the server closed `c` (or answered it) within `within`; the answer's status line.
fn closed_within(c: &mut TcpStream, within: Duration) -> Option<String> {
    c.set_read_timeout(Some(within)).expect("timeout");
    let mut buf = Vec::new();
    match c.read_to_end(&mut buf) {
        Ok(_) => Some(
            String::from_utf8_lossy(&buf)
                .lines()
                .next()
                .unwrap_or("")
                .into(),
        ),
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Some(String::new()),
        Err(_) => None,
    }
}

#[test]
fn clients_that_never_finish_their_body_cannot_lock_the_server() {
    let s = start(
        &nibble_tests::fixture("minilm-nf4/model"),
        &[
            "--max-connections",
            "4",
            "--idle-timeout",
            "2",
            "--body-timeout",
            "4",
        ],
    );
    // Every connection taken by a client that sent headers and 5 body bytes.
    let t0 = Instant::now();
    let mut stuck: Vec<TcpStream> = (0..4).map(|_| half_sent(&s.addr, 5)).collect();
    // /health waits in the listen queue until the idle timer frees a connection.
    let (status, _, _) = s.request("GET", "/health", &[], b"");
    assert_eq!(status, 200);
    let waited = t0.elapsed();
    assert!(waited < Duration::from_secs(8), "/health waited {waited:?}");
    for c in &mut stuck {
        assert!(
            closed_within(c, Duration::from_secs(5)).is_some(),
            "a stalled body is cut"
        );
    }
    // A client that trickles a byte a second is never idle: --body-timeout ends it with 408.
    let mut c = half_sent(&s.addr, 1);
    let t0 = Instant::now();
    let answer = loop {
        std::thread::sleep(Duration::from_millis(900));
        if c.write_all(b" ").is_err() || t0.elapsed() > Duration::from_secs(12) {
            break closed_within(&mut c, Duration::from_secs(2));
        }
        c.set_nonblocking(true).expect("nonblocking");
        let mut b = [0u8; 64];
        let got = c.read(&mut b);
        c.set_nonblocking(false).expect("blocking");
        if let Ok(n) = got {
            break Some(
                String::from_utf8_lossy(&b[..n])
                    .lines()
                    .next()
                    .unwrap_or("")
                    .into(),
            );
        }
    };
    let took = t0.elapsed();
    let line = answer.expect("the trickling client was answered");
    assert!(line.contains("408"), "{line:?}");
    assert!(took < Duration::from_secs(8), "408 after {took:?}");
}

#[test]
fn embeddings_are_bounded_admitted_and_dropped_when_the_client_leaves() {
    let dir = nibble_tests::fixture("minilm-nf4/model");
    let s = start(&dir, &["--max-batch", "1", "--queue", "0"]);
    // Too many inputs: refused before any is computed.
    let many: Vec<String> = (0..2049).map(|i| format!("text {i}")).collect();
    let (status, v) = s.post("/v1/embeddings", &json!({"input": many}));
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .expect("message")
            .contains("2048"),
        "{v}"
    );
    // A long request holds the one place: a second one at the same time gets 503.
    let long: Vec<String> = (0..2000)
        .map(|i| format!("sentence number {i} about things"))
        .collect();
    let body = json!({"input": long}).to_string();
    let mut c = TcpStream::connect(&s.addr).expect("connect");
    write!(
        c,
        "POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    std::thread::sleep(Duration::from_millis(1500));
    let (status, head, _) = s.request("POST", "/v1/embeddings", &[], br#"{"input": "hi"}"#);
    assert_eq!(status, 503, "{head}");
    assert!(head.to_ascii_lowercase().contains("retry-after:"), "{head}");
    // The client leaves: its job stops at the next input and frees the place.
    drop(c);
    let t0 = Instant::now();
    loop {
        let (status, v) = s.post("/v1/embeddings", &json!({"input": "hi"}));
        if status == 200 {
            break;
        }
        assert_eq!(status, 503, "{v}");
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the abandoned job ran on"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    assert!(s.metric("sequences_cancelled_total") >= 1.0);
}

#[test]
fn unsupported_request_parts_are_refused() {
    let minilm = nibble_tests::fixture("minilm-nf4/model");
    let s = start(&minilm, &[]);
    let (status, v) = s.post("/v1/embeddings", &json!({"input": "hi", "dimensions": 8}));
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .expect("message")
            .contains("dimensions"),
        "{v}"
    );
    // The model's own width is what it gives: asking for it is fine.
    let (status, v) = s.post("/v1/embeddings", &json!({"input": "hi", "dimensions": 384}));
    assert_eq!(status, 200, "{v}");
    let (status, _, b) = s.request(
        "POST",
        "/v1/embeddings",
        &[],
        br#"{"input": "hi"} trailing"#,
    );
    assert_eq!(status, 400, "{}", String::from_utf8_lossy(&b));
    let (status, _, _) = s.request("POST", "/v1/embeddings", &[], b"{\"input\": \"hi\"}\n ");
    assert_eq!(status, 200, "white space after the JSON is fine");
    drop(s);

    let dir = tempfile::tempdir().expect("tmp");
    byte_fallback_llama(dir.path());
    let s = start(dir.path(), &["--max-context", "64"]);
    let image = json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}});
    for content in [
        json!([image]),
        json!([{"type": "text", "text": "what is this?"}, image]),
    ] {
        let req = json!({"messages": [{"role": "user", "content": content}], "max_tokens": 2});
        let (status, v) = s.post("/v1/chat/completions", &req);
        assert_eq!(status, 400, "{v}");
        let msg = v["error"]["message"].as_str().expect("message");
        assert!(
            msg.contains("image_url") && msg.contains("messages[0]"),
            "{msg}"
        );
    }
    // Bytes after the JSON body of a chat request or a completion are refused too.
    for path in ["/v1/chat/completions", "/v1/completions"] {
        let body = if path.ends_with("chat/completions") {
            br#"{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1} {"#.to_vec()
        } else {
            br#"{"prompt": "hi", "max_tokens": 1}garbage"#.to_vec()
        };
        let (status, _, b) = s.request("POST", path, &[], &body);
        assert_eq!(status, 400, "{path}: {}", String::from_utf8_lossy(&b));
    }
}

/// Fault 8: a small model whose prefill chunk makes activations dominate needs less device
/// memory with every weight resident than with every group streamed; the auto budget and the
/// planner take the smaller, and the server starts instead of refusing with a contradiction.
#[test]
fn a_small_model_with_long_prefill_chunks_starts() {
    let dir = tempfile::tempdir().expect("tmp");
    nibble_tests::copy_dir(&nibble_tests::fixture("tiny-llama-nf4/model"), dir.path());
    let tok = nibble_tests::text::byte_fallback_tokenizer(300);
    std::fs::write(dir.path().join("tokenizer.json"), tok.to_string()).expect("tokenizer.json");
    for chunk in ["512", "4096"] {
        let s = start(dir.path(), &["--prefill-chunk", chunk]);
        let (status, v) = s.post(
            "/v1/completions",
            &json!({"prompt": [1, 2, 3], "max_tokens": 2}),
        );
        assert_eq!(status, 200, "--prefill-chunk {chunk}: {v}");
    }
}
