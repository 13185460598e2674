//! `nibble serve --model`: the OpenAI-compatible API on SmolLM2 (models/smollm2-135m-nf4, made by
//! scripts/get-smollm2.sh, which the README's test command runs) and on the MiniLM fixture.
//! - chat completions, whole and streamed, equal `nibble run --chat` for the same prompt and
//!   token limit, with the right `usage`;
//! - 8 concurrent streams, each equal to its solo run; the metrics show batches above 1;
//! - a client that leaves after 3 tokens frees its sequence; the next request succeeds;
//! - bad requests get their status and an OpenAI error object, and a good request follows;
//!   the API key; a full queue gets 503 with Retry-After; a completion longer than the idle
//!   timeout is not cut off;
//! - embeddings (float and base64) equal `nibble run`'s;
//! - the `openai` Python package as the client (scripts/test.sh installs it).

use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use nibble_tests::process::Served;
use serde_json::{json, Value};

fn smollm2() -> PathBuf {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/smollm2-135m-nf4");
    assert!(
        p.join("model.safetensors").is_file(),
        "{} is missing: run scripts/get-smollm2.sh",
        p.display()
    );
    p
}

/// A running `nibble serve --model`; killed when dropped.
struct Server(Served);

impl std::ops::Deref for Server {
    type Target = Served;
    fn deref(&self) -> &Served {
        &self.0
    }
}

impl Server {
    fn start(model: &std::path::Path, extra: &[&str]) -> Server {
        Server(Served::api(env!("CARGO_BIN_EXE_nibble"), model, extra))
    }
}

/// One SmolLM2 server for the tests of this file (they run at once: its batches mix them).
fn shared() -> &'static Server {
    static S: OnceLock<Server> = OnceLock::new();
    S.get_or_init(|| Server::start(&smollm2(), &["--max-context", "256", "--max-batch", "8"]))
}

fn chat(text: &str, max_tokens: u64, stream: bool) -> Value {
    json!({"model": "smollm2-135m-nf4", "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens, "temperature": 0, "stream": stream,
        "stream_options": {"include_usage": true}})
}

/// Concatenated content of a streamed chat, its finish reason and its usage.
fn streamed_text(events: &[String]) -> (String, String, Value) {
    assert_eq!(
        events.last().map(String::as_str),
        Some("[DONE]"),
        "ends with [DONE]"
    );
    let (mut text, mut finish, mut usage) = (String::new(), String::new(), Value::Null);
    for e in &events[..events.len() - 1] {
        let v: Value = serde_json::from_str(e).expect("event json");
        assert_eq!(v["object"], "chat.completion.chunk");
        if let Some(c) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(c);
        }
        if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
            finish = f.to_string();
        }
        if !v["usage"].is_null() {
            usage = v["usage"].clone();
        }
    }
    (text, finish, usage)
}

/// `nibble run --json` on `model` with these options, on the CPU backend.
fn run_json(model: &std::path::Path, args: &[&str]) -> Value {
    let out = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["run", "--model"])
        .arg(model)
        .args(["--backend", "cpu", "--json"])
        .args(args)
        .output()
        .expect("nibble run");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

/// `nibble run --chat --json` on SmolLM2: (text, prompt ids, tokens).
fn run_chat(text: &str, max_tokens: u64) -> (String, usize, usize) {
    let n = max_tokens.to_string();
    let v = run_json(
        &smollm2(),
        &["--chat", "--prompt", text, "--max-tokens", &n],
    );
    (
        v["text"].as_str().expect("text").to_string(),
        v["prompt_ids"].as_array().expect("ids").len(),
        v["tokens"].as_array().expect("tokens").len(),
    )
}

fn reference_prompts() -> Vec<String> {
    let r = nibble_tests::read_json(&nibble_tests::fixture("smollm2/reference.json"));
    r["prompts"]
        .as_array()
        .expect("prompts")
        .iter()
        .map(|p| p["user_message"].as_str().expect("message").to_string())
        .collect()
}

#[test]
fn chat_completions_equal_nibble_run_with_usage() {
    let s = shared();
    for prompt in reference_prompts() {
        let (want, prompt_len, tokens) = run_chat(&prompt, 24);
        let (status, v) = s.post("/v1/chat/completions", &chat(&prompt, 24, false));
        assert_eq!(status, 200, "{v}");
        assert_eq!(v["object"], "chat.completion");
        assert_eq!(v["choices"][0]["message"]["role"], "assistant");
        assert_eq!(
            v["choices"][0]["message"]["content"],
            want.as_str(),
            "{prompt}"
        );
        assert_eq!(v["usage"]["prompt_tokens"], prompt_len);
        assert_eq!(v["usage"]["completion_tokens"], tokens);
        assert_eq!(v["usage"]["total_tokens"], prompt_len + tokens);
        let finish = if tokens < 24 { "stop" } else { "length" };
        assert_eq!(v["choices"][0]["finish_reason"], finish);
        let (text, f, usage) =
            streamed_text(&s.stream("/v1/chat/completions", &chat(&prompt, 24, true)));
        assert_eq!(text, want, "streamed: {prompt}");
        assert_eq!(f, finish);
        assert_eq!(usage["completion_tokens"], tokens);
    }
}

#[test]
fn eight_concurrent_streams_each_equal_their_solo_run() {
    let s = shared();
    let prompts: Vec<String> = [
        "What is the capital of France?",
        "Name three colors.",
        "Write a haiku about the sea.",
        "What is 2 + 2?",
        "Who wrote Hamlet?",
        "Give me a fruit.",
        "Explain gravity in one sentence.",
        "Say hello in Spanish.",
    ]
    .iter()
    .map(|p| p.to_string())
    .collect();
    let solo: Vec<String> = prompts
        .iter()
        .map(|p| streamed_text(&s.stream("/v1/chat/completions", &chat(p, 16, true))).0)
        .collect();
    let handles: Vec<_> = prompts
        .iter()
        .map(|p| {
            let body = chat(p, 16, true);
            std::thread::spawn(move || {
                streamed_text(&shared().stream("/v1/chat/completions", &body)).0
            })
        })
        .collect();
    for ((h, want), p) in handles.into_iter().zip(&solo).zip(&prompts) {
        assert_eq!(&h.join().expect("client"), want, "{p}");
    }
    assert!(
        s.metric("batch_size_max") > 1.0,
        "the streams were decoded together"
    );
}

#[test]
fn a_client_that_leaves_frees_its_sequence() {
    let s = Server::start(&smollm2(), &["--max-context", "256", "--max-batch", "2"]);
    let mut c = TcpStream::connect(&s.addr).expect("connect");
    let body = json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
        "stream": true})
    .to_string();
    write!(
        c,
        "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .expect("write");
    let mut r = BufReader::new(c.try_clone().expect("clone"));
    let mut events = 0;
    let mut line = String::new();
    while events < 3 {
        line.clear();
        assert!(
            r.read_line(&mut line).expect("read") > 0,
            "the stream ended early"
        );
        if line.starts_with("data: ") {
            events += 1;
        }
    }
    drop(r);
    c.shutdown(std::net::Shutdown::Both).expect("close");
    drop(c);
    let t0 = Instant::now();
    while s.metric("sequences_cancelled_total") < 1.0 || s.metric("active_sequences") > 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "the sequence was not freed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        s.metric("completion_tokens_total") < 200.0,
        "it stopped early"
    );
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"prompt": "Hello", "max_tokens": 4}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(
        v["usage"]["completion_tokens"].as_u64().map(|n| n <= 4),
        Some(true)
    );
}

#[test]
fn bad_requests_get_their_status_and_an_error_object() {
    let s = shared();
    let chat_path = "/v1/chat/completions";
    let cases: Vec<(&str, Vec<u8>, u16)> = vec![
        ("malformed JSON", b"{\"messages\": [".to_vec(), 400),
        ("a field of the wrong type", br#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": "ten"}"#.to_vec(), 400),
        ("messages not a list", br#"{"messages": "hi"}"#.to_vec(), 400),
        ("an unknown model", br#"{"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}"#.to_vec(), 404),
        ("max_tokens beyond the context", br#"{"messages": [{"role": "user", "content": "x"}], "max_tokens": 100000}"#.to_vec(), 400),
        ("a prompt longer than the context", json!({"messages": [{"role": "user", "content": "word ".repeat(400)}], "max_tokens": 4}).to_string().into_bytes(), 400),
        ("n = 2", br#"{"messages": [{"role": "user", "content": "x"}], "n": 2}"#.to_vec(), 400),
        ("a body over the limit", vec![b' '; 5 << 20], 413),
    ];
    for (what, body, want) in cases {
        let (status, _, b) = s.request(
            "POST",
            chat_path,
            &[("Content-Type", "application/json")],
            &body,
        );
        assert_eq!(status, want, "{what}: {}", String::from_utf8_lossy(&b));
        let v: Value = serde_json::from_slice(&b).unwrap_or_else(|_| panic!("{what}: not JSON"));
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{what}: {v}"
        );
        assert!(v["error"]["type"].is_string(), "{what}: {v}");
    }
    let (status, _) = s.post("/v1/embeddings", &json!({"input": "x"}));
    assert_eq!(status, 400, "a decoder has no embeddings");
    // An unknown path is a 404 without OpenAI's `model_not_found` code; an unknown model has it;
    // a wrong method is a 405 with an error object (hardening round two, fault 5).
    let (status, _, b) = s.request("GET", "/v1/nothing", &[], b"");
    assert_eq!(status, 404);
    let v: Value = serde_json::from_slice(&b).expect("404 json");
    assert!(
        v["error"]["code"].is_null() && v["error"]["message"].is_string(),
        "{v}"
    );
    let (status, v) = s.post(
        chat_path,
        &json!({"model": "gpt-9", "messages": [{"role": "user", "content": "x"}]}),
    );
    assert_eq!(
        (status, v["error"]["code"].as_str()),
        (404, Some("model_not_found")),
        "{v}"
    );
    for (method, path) in [
        ("GET", chat_path),
        ("POST", "/v1/models"),
        ("DELETE", "/v1/plan"),
    ] {
        let (status, _, b) = s.request(method, path, &[], b"");
        assert_eq!(status, 405, "{method} {path}");
        let v: Value = serde_json::from_slice(&b)
            .unwrap_or_else(|_| panic!("{method} {path}: {}", String::from_utf8_lossy(&b)));
        assert!(v["error"]["message"].is_string(), "{method} {path}: {v}");
    }
    let (status, v) = s.post(chat_path, &chat("Hi", 3, false));
    assert_eq!(status, 200, "a good request after the bad ones: {v}");
    let (status, _, plan) = s.request("GET", "/v1/plan", &[], b"");
    let plan: Value = serde_json::from_slice(&plan).expect("plan json");
    assert_eq!(status, 200);
    assert!(
        plan["plan"]["tiers"].is_array() && plan["max_batch"] == 8,
        "{plan}"
    );
    let (status, _, models) = s.request("GET", "/v1/models", &[], b"");
    assert_eq!(status, 200);
    let models: Value = serde_json::from_slice(&models).expect("models json");
    assert_eq!(models["data"][0]["id"], "smollm2-135m-nf4");
}

/// An API key no client can send is refused at start (hardening round two, fault 7).
#[test]
fn an_empty_api_key_is_refused_at_start() {
    // Empty, blank, with a space, and with characters a header cannot carry as text.
    for key in ["", " ", "a b", "cl\u{e9}", "k\u{1f511}"] {
        let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args(["serve", "--model"])
            .arg(smollm2())
            .args(["--api-key", key])
            .output()
            .expect("run");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "{key:?}: {err}");
        assert!(
            err.contains("an API key is one or more visible ASCII characters"),
            "{err}"
        );
    }
}

#[test]
fn the_api_key_and_the_queue_are_enforced() {
    let s = Server::start(
        &smollm2(),
        &[
            "--max-context",
            "256",
            "--max-batch",
            "1",
            "--queue",
            "0",
            "--api-key",
            "sekrit",
            "--idle-timeout",
            "1",
        ],
    );
    let body = chat("Hi", 3, false).to_string();
    let ct = ("Content-Type", "application/json");
    for auth in [None, Some("Bearer wrong")] {
        let h: Vec<(&str, &str)> = [Some(ct), auth.map(|a| ("Authorization", a))]
            .into_iter()
            .flatten()
            .collect();
        let (status, _, b) = s.request("POST", "/v1/chat/completions", &h, body.as_bytes());
        assert_eq!(status, 401, "{}", String::from_utf8_lossy(&b));
    }
    let good = [ct, ("Authorization", "Bearer sekrit")];
    let (status, _, _) = s.request("POST", "/v1/chat/completions", &good, body.as_bytes());
    assert_eq!(status, 200);
    // A completion that takes longer than the idle timeout (1 s) before its first byte is not
    // cut off: the connection is busy, not idle.
    let slow = json!({"prompt": "Once upon a time", "max_tokens": 200, "temperature": 0,
        "ignore_eos": true})
    .to_string();
    let t0 = Instant::now();
    let (status, _, b) = s.request("POST", "/v1/completions", &good, slow.as_bytes());
    assert_eq!(status, 200, "{}", String::from_utf8_lossy(&b));
    let v: Value = serde_json::from_slice(&b).expect("json");
    assert_eq!(v["usage"]["completion_tokens"], 200);
    println!("200 tokens in {:?}", t0.elapsed());
    // One slot, no queue: while a long request holds the slot, the next one is refused.
    let long = json!({"messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 200, "temperature": 0, "stream": true})
    .to_string();
    let mut c = TcpStream::connect(&s.addr).expect("connect");
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: Bearer sekrit\r\nContent-Length: {}\r\n\r\n{long}",
        long.len()
    )
    .expect("write");
    let mut r = BufReader::new(c.try_clone().expect("clone"));
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        assert!(r.read_line(&mut line).expect("read") > 0);
    }
    let (status, head, b) = s.request("POST", "/v1/chat/completions", &good, body.as_bytes());
    assert_eq!(status, 503, "{}", String::from_utf8_lossy(&b));
    assert!(head.to_ascii_lowercase().contains("retry-after:"), "{head}");
}

#[test]
fn embeddings_equal_nibble_run() {
    let dir = nibble_tests::fixture("minilm-nf4/model");
    let s = Server::start(&dir, &[]);
    let texts = ["A man is eating food.", "The weather is nice today"];
    let mut want = Vec::new();
    for t in texts {
        let v = run_json(&dir, &["--prompt", t]);
        want.push(
            v["embedding"]
                .as_array()
                .expect("embedding")
                .iter()
                .map(|x| x.as_f64().expect("f") as f32)
                .collect::<Vec<f32>>(),
        );
    }
    let (status, v) = s.post("/v1/embeddings", &json!({"input": texts}));
    assert_eq!(status, 200, "{v}");
    for (i, w) in want.iter().enumerate() {
        let got: Vec<f32> = v["data"][i]["embedding"]
            .as_array()
            .expect("embedding")
            .iter()
            .map(|x| x.as_f64().expect("f") as f32)
            .collect();
        let e = nibble_tests::max_abs_err(&got, w);
        assert!(e <= 2e-5, "input {i}: {e}");
    }
    assert!(v["usage"]["prompt_tokens"].as_u64().is_some_and(|n| n > 0));
    let (status, b) = s.post(
        "/v1/embeddings",
        &json!({"input": texts[0], "encoding_format": "base64"}),
    );
    assert_eq!(status, 200, "{b}");
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(b["data"][0]["embedding"].as_str().expect("base64"))
        .expect("decode");
    let got: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().expect("4")))
        .collect();
    assert!(nibble_tests::max_abs_err(&got, &want[0]) <= 2e-5);
    let (status, _) = s.post("/v1/chat/completions", &chat("x", 2, false));
    assert_eq!(status, 400, "an encoder has no completions");
}

/// The `openai` Python package (installed by scripts/test.sh into a tools folder, its path in
/// NIBBLE_OPENAI_PY) as the client: whole and streamed chat at temperature 0 equal `nibble run
/// --chat`, with the right usage.
#[test]
fn the_openai_python_client_gets_nibble_runs_text() {
    let Ok(path) = std::env::var("NIBBLE_OPENAI_PY") else {
        assert!(
            std::env::var("NIBBLE_REQUIRE_OPENAI").ok().as_deref() != Some("1"),
            "NIBBLE_OPENAI_PY is not set: scripts/test.sh installs the openai package"
        );
        println!("the openai package is absent: not run");
        return;
    };
    let s = shared();
    let prompt = reference_prompts().remove(0);
    let (want, prompt_len, tokens) = run_chat(&prompt, 20);
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/openai_client.py");
    let out = Command::new("python3")
        .arg(&script)
        .env("PYTHONPATH", &path)
        .args([format!("http://{}/v1", s.addr), prompt, "20".into()])
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: Value = serde_json::from_slice(&out.stdout).expect("the script's json");
    assert_eq!(v["text"], want.as_str());
    assert_eq!(v["streamed"], want.as_str());
    assert_eq!(v["prompt_tokens"], prompt_len);
    assert_eq!(v["completion_tokens"], tokens);
    assert_eq!(v["stream_usage"]["completion_tokens"], tokens);
}
