//! `nibble plan`: the plan of a run without reading a weight byte. Over HTTP the server sees
//! only the config, the header and the quant-state JSONs of the weights file; the plan names its
//! tiers and the smallest device budget, which then runs.

use std::collections::HashMap;
use std::process::Command;

use nibble_tests::http_server::{Fault, TestServer};

/// `nibble plan --json --model MODEL ARGS...`, which must succeed.
fn plan_json(model_and_args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["plan", "--json", "--model"])
        .args(model_and_args)
        .output()
        .expect("nibble plan");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("json")
}

#[test]
fn a_plan_reads_no_weight_byte_and_its_smallest_budget_runs() {
    let dir = nibble_tests::fixture("tiny-llama-nf4/model");
    let mut files = HashMap::new();
    for f in ["config.json", "generation_config.json", "model.safetensors"] {
        files.insert(
            format!("m/{f}"),
            std::fs::read(dir.join(f)).expect("fixture file"),
        );
    }
    let srv = TestServer::start(files, Fault::None);
    let url = format!("{}/m", srv.base);
    let v = plan_json(&[
        &url,
        "--backend",
        "cpu",
        "--prompt-ids",
        "1,2,3",
        "--max-tokens",
        "8",
    ]);
    let phase = &v["phases"][0];
    let tiers: Vec<&str> = phase["plan"]["tiers"]
        .as_array()
        .expect("tiers")
        .iter()
        .map(|t| t["name"].as_str().expect("name"))
        .collect();
    assert_eq!(tiers, ["device", "host", "source"]);
    assert!(v["budget"]["note"]
        .as_str()
        .unwrap_or("")
        .contains("device budget auto"));
    // What the server sent of the weights file: its first 8 bytes, the header, the quant-state
    // JSON tensors, nothing else.
    let h = nibble_core::io::model::read_header(&dir.join("model.safetensors")).expect("header");
    let allowed: u64 = 8
        + h.header_len
        + h.tensors
            .iter()
            .filter(|t| t.name.contains(".quant_state."))
            .map(|t| t.len)
            .sum::<u64>();
    let sent = srv
        .stats()
        .bytes_by_path
        .get("m/model.safetensors")
        .copied()
        .unwrap_or(0);
    assert!(
        sent >= 8 + h.header_len,
        "the header was read: {sent} bytes"
    );
    assert!(
        sent <= allowed,
        "the plan read {sent} bytes of the weights file, more than the {allowed} of its header and quant states"
    );
    // The smallest budget it names runs.
    let least = phase["min_device_bytes"].as_u64().expect("min");
    let run = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["run", "--model"])
        .arg(&dir)
        .args([
            "--backend",
            "cpu",
            "--prompt-ids",
            "1,2,3",
            "--max-tokens",
            "8",
        ])
        .args(["--device-budget", &least.to_string()])
        .output()
        .expect("nibble run");
    assert!(
        run.status.success(),
        "the smallest budget {least} does not run: {}",
        String::from_utf8_lossy(&run.stderr)
    );
}

/// On wgpu, which tells limits but not free memory, `--device-budget auto` keeps every weight
/// resident within three quarters of the adapter's `max_buffer_size`, and the plan says so.
#[test]
fn wgpu_auto_device_budget_is_a_stated_share_of_the_adapter_limit() {
    let Some(backend) = nibble_tests::wgpu_or_absent("the wgpu auto budget") else {
        return;
    };
    let limit = backend.limits().max_buffer_size;
    let dir = nibble_tests::fixture("tiny-llama-nf4/model");
    let dir = dir.to_str().expect("utf8");
    let v = plan_json(&[dir, "--backend", "wgpu", "--prompt-ids", "1,2,3"]);
    let note = v["budget"]["note"].as_str().unwrap_or("");
    assert!(
        note.contains("3/4 of the adapter's max_buffer_size"),
        "the note states the share: {note}"
    );
    let device = v["budget"]["device_budget_bytes"]
        .as_u64()
        .expect("device_budget_bytes");
    assert!(device > 0 && device <= limit / 4 * 3, "{device} of {limit}");
}

/// A synthetic 48 MiB Llama (in a temporary folder, kept while the first value lives), its
/// path, and a device budget halfway between its smallest and every weight resident (CPU).
fn llama_and_a_mid_budget(seed: u64) -> (tempfile::TempDir, String, String) {
    let tmp = tempfile::tempdir().expect("tmp");
    let dir = tmp.path().join("llama");
    nibble_tests::synth(
        std::path::Path::new(env!("CARGO_BIN_EXE_nibble")),
        "llama",
        "48MiB",
        seed,
        &dir,
    );
    let dir = dir.to_str().expect("utf8").to_string();
    let v = plan_json(&[&dir, "--backend", "cpu", "--prompt-ids", "1,2,3"]);
    let phase = &v["phases"][0];
    let (min, all) = (
        phase["min_device_bytes"].as_u64().expect("min"),
        phase["resident_device_bytes"].as_u64().expect("resident"),
    );
    (tmp, dir, ((min + all) / 2).to_string())
}

/// The layers a device budget cannot hold are spread between those it holds, so that each one's
/// read overlaps the compute of resident layers before it: with about half the layers resident,
/// no run of resident layers is longer than twice the even spacing, and the plan prints the
/// tiers as ranges with gaps.
#[test]
fn streamed_layers_are_spread_between_resident_ones() {
    let (_tmp, dir, budget) = llama_and_a_mid_budget(3);
    let args = [&dir[..], "--backend", "cpu", "--prompt-ids", "1,2,3"];
    let v = plan_json(&[&args[..], &["--device-budget", &budget]].concat());
    let tiers = v["phases"][0]["plan"]["tiers"].as_array().expect("tiers");
    let layers = |name: &str| -> Vec<usize> {
        tiers.iter().find(|t| t["name"] == name).expect("tier")["groups"]
            .as_array()
            .expect("groups")
            .iter()
            .filter_map(|g| g.as_str()?.strip_prefix("model.layers.")?.parse().ok())
            .collect()
    };
    let (device, source) = (layers("device"), layers("source"));
    let n = device.len() + source.len();
    assert!(
        n >= 8 && device.len() >= 2 && source.len() >= 2,
        "about half of {n} layers resident: {device:?} / {source:?}"
    );
    let mut resident = vec![false; n];
    for &l in &device {
        resident[l] = true;
    }
    let longest = resident.split(|&r| !r).map(|r| r.len()).max().unwrap_or(0);
    assert!(
        longest <= 2 * n / source.len() + 1,
        "a run of {longest} resident layers of {n} (streamed: {source:?})"
    );
    let text = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["plan", "--model"])
        .args(args)
        .args(["--device-budget", &budget])
        .output()
        .expect("nibble plan");
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("model.layers.{"),
        "the tiers print as ranges with gaps: {text}"
    );
}

/// With `--slots` `auto` (the default) the ring grows from its 4 slots to at least 16 and until
/// it holds the largest group the plan streams, so that a group's read can overlap the compute before it;
/// a ring given in full is kept; both runs give the same tokens.
#[test]
fn an_auto_ring_holds_the_largest_streamed_group() {
    let (_tmp, dir, budget) = llama_and_a_mid_budget(5);
    let args = [&dir[..], "--backend", "cpu", "--prompt-ids", "1,2,3"];
    let small = [
        &args[..],
        &["--device-budget", &budget, "--slot-size", "64KiB"],
    ]
    .concat();
    let auto = plan_json(&small);
    let plan = &auto["phases"][0]["plan"];
    let largest = plan["tiers"]
        .as_array()
        .expect("tiers")
        .iter()
        .filter(|t| t["name"] != "device")
        .map(|t| t["largest_group_bytes"].as_u64().expect("largest"))
        .max()
        .expect("tiers");
    let ring = &plan["ring"];
    assert!(
        largest > 4 * 65536 && ring["slot_bytes"] == 65536,
        "a streamed group larger than 4 slots: {plan}"
    );
    // Whole slots, a tensor's last piece not shared with the next tensor's first at worst.
    let bytes = ring["bytes"].as_u64().expect("ring bytes");
    assert!(
        bytes >= largest && bytes <= (2 * largest + 65536).max(16 * 65536),
        "the ring ({ring}) holds the largest streamed group ({largest} B)"
    );
    let note = auto["budget"]["note"].as_str().expect("note");
    assert!(
        note.contains("ring auto") && note.contains("holds the largest streamed group"),
        "{note}"
    );
    let given = plan_json(&[&small[..], &["--slots", "4"]].concat());
    assert_eq!(
        given["phases"][0]["plan"]["ring"]["bytes"],
        4 * 65536,
        "{given}"
    );
    let tokens = |extra: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args([
                "run",
                "--json",
                "--max-tokens",
                "4",
                "--ignore-eos",
                "--model",
            ])
            .args(&small)
            .args(extra)
            .output()
            .expect("nibble run");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("json");
        assert!(
            v["plan"]["streamed_groups"].as_u64() > Some(0),
            "{}",
            v["plan"]
        );
        v["tokens"].clone()
    };
    assert_eq!(tokens(&[]), tokens(&["--slots", "4"]));
}
