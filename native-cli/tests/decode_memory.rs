//! Streaming a decode: SmolLM2 in NF4 with a device budget far below the model, so that the
//! decoder layers stream through a 2 x 4 MiB ring for every token. Over 256 generated tokens the
//! process's RSS stays flat (growth <= 1 MiB after token 2) and the tokens equal the resident
//! run's. Asserts bytes, never time. Needs models/smollm2-135m-nf4 (scripts/get-smollm2.sh, which
//! the README's test command runs).

use std::process::Command;

const MIB: i64 = 1 << 20;

fn run(extra: &[&str]) -> serde_json::Value {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/smollm2-135m-nf4");
    assert!(
        model.join("model.safetensors").is_file(),
        "{} is missing: run scripts/get-smollm2.sh",
        model.display()
    );
    let out = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["run", "--model"])
        .arg(&model)
        .args([
            "--chat",
            "--prompt",
            "Tell me a long story about a lighthouse keeper.",
            "--max-tokens",
            "256",
            "--ignore-eos",
            "--backend",
            "cpu",
            "--json",
        ])
        .args(extra)
        .output()
        .expect("run nibble");
    assert!(
        out.status.success(),
        "nibble run failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

#[test]
fn streamed_decode_is_flat_and_equals_resident() {
    let resident = run(&[]);
    assert_eq!(
        resident["plan"]["streamed_groups"], 0,
        "{}",
        resident["plan"]
    );
    let streamed = run(&[
        "--device-budget",
        "80MiB",
        "--slots",
        "2",
        "--slot-size",
        "4MiB",
    ]);
    let plan = &streamed["plan"];
    assert!(
        plan["streamed_groups"].as_u64().unwrap_or(0) >= 20,
        "most layers stream: {plan}"
    );
    assert!(
        plan["device_bytes"].as_u64().unwrap_or(u64::MAX) <= 128 << 20,
        "{plan}"
    );
    assert!(streamed["bytes_streamed"].as_u64().unwrap_or(0) > 256 * (20 << 20));
    assert_eq!(
        streamed["tokens"], resident["tokens"],
        "streamed tokens equal resident"
    );
    let rss: Vec<i64> = streamed["rss_bytes_per_token"]
        .as_array()
        .expect("rss")
        .iter()
        .map(|v| v.as_i64().expect("bytes"))
        .collect();
    assert_eq!(rss.len(), 256);
    let growth = rss[255] - rss[1];
    let max_after = rss[1..].iter().max().copied().unwrap_or(0) - rss[1];
    println!(
        "RSS after token 2: {} B, after token 256: {} B, growth {growth} B, max above token 2: {max_after} B; streamed {} B",
        rss[1], rss[255], streamed["bytes_streamed"]
    );
    assert!(
        growth <= MIB,
        "RSS grew by {growth} bytes from token 2 to 256"
    );
    assert!(
        max_after <= MIB,
        "RSS rose by {max_after} bytes above token 2's"
    );
}
