//! The host budget: on the CPU backend device memory is host memory, so `--device-budget auto`
//! (the default) keeps every weight resident only while that fits the host budget less the
//! process and the ring; with a host budget below the resident size, the decoder layers that do
//! not fit stream, and the tokens equal the resident run's. A host budget too small for the
//! plan is refused before anything is read, naming the figures. Needs models/smollm2-135m-nf4
//! (scripts/get-smollm2.sh, which the README's test command runs).

use std::process::{Command, Output};

const MIB: u64 = 1 << 20;

/// `nibble run --json` on SmolLM2 with a fixed prompt on `backend`.
fn smollm2(backend: &str, max_tokens: &str, extra: &[&str]) -> Output {
    let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/smollm2-135m-nf4");
    assert!(
        model.join("model.safetensors").is_file(),
        "{} is missing: run scripts/get-smollm2.sh",
        model.display()
    );
    Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["run", "--model"])
        .arg(&model)
        .args([
            "--prompt-ids",
            "1,504,3575,282,4649,314",
            "--ignore-eos",
            "--json",
        ])
        .args(["--max-tokens", max_tokens, "--backend", backend])
        .args(extra)
        .output()
        .expect("run nibble")
}

/// On the CPU backend, through a 2 x 4 MiB ring.
fn run(extra: &[&str]) -> Output {
    let ring = ["--slots", "2", "--slot-size", "4MiB"];
    smollm2("cpu", "6", &[&ring[..], extra].concat())
}

fn json(o: &Output) -> serde_json::Value {
    assert!(
        o.status.success(),
        "nibble run failed: {}",
        String::from_utf8_lossy(&o.stderr)
    );
    serde_json::from_slice(&o.stdout).expect("json")
}

#[test]
fn auto_device_budget_stays_within_the_host_budget() {
    let resident = json(&run(&["--host-budget", "1TiB"]));
    assert_eq!(
        resident["plan"]["streamed_groups"], 0,
        "{}",
        resident["plan"]
    );
    let device = resident["plan"]["device_bytes"]
        .as_u64()
        .expect("device bytes");
    let rss = resident["budget"]["rss_at_plan_bytes"]
        .as_u64()
        .expect("rss at plan");
    // Room for three quarters of the resident device memory besides the process and the ring
    // (more than the smallest budget: the embedding table stays in the arena).
    let host = rss + 8 * MIB + device * 3 / 4;
    let capped = json(&run(&["--host-budget", &host.to_string()]));
    let plan = &capped["plan"];
    assert!(
        plan["streamed_groups"].as_u64().unwrap_or(0) > 0,
        "with a {host} B host budget some layers stream: {plan}"
    );
    assert!(
        plan["device_bytes"].as_u64().unwrap_or(u64::MAX) <= device * 3 / 4 + 2 * MIB,
        "the device budget was capped: {plan} (resident {device})"
    );
    assert!(
        capped["budget"]["note"]
            .as_str()
            .unwrap_or("")
            .contains("every weight resident would need"),
        "{}",
        capped["budget"]
    );
    assert_eq!(
        capped["tokens"], resident["tokens"],
        "the streamed run's tokens equal the resident run's"
    );
    assert!(
        capped["rss_max_bytes"].as_u64().unwrap_or(u64::MAX) <= host + 16 * MIB,
        "peak RSS {} over the host budget {host} + 16 MiB",
        capped["rss_max_bytes"]
    );
}

#[test]
fn a_host_budget_the_plan_cannot_fit_is_refused_before_reading() {
    // Below the process's own memory and the ring.
    let o = run(&["--host-budget", "1MiB"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("cannot hold the process"), "{err}");
    // Room for the process and the ring, but not for the smallest device memory of the run.
    let o = run(&["--host-budget", "60MiB"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("leaves") && err.contains("needs at least"),
        "{err}"
    );
    // A given device budget whose plan (every weight resident, ~110 MiB on the CPU backend,
    // which is host memory) needs more host memory than the host budget.
    let o = run(&["--host-budget", "90MiB", "--device-budget", "190MiB"]);
    assert!(!o.status.success());
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("of host memory") && err.contains("over the host budget"),
        "{err}"
    );
}

fn run_wgpu(extra: &[&str]) -> serde_json::Value {
    json(&smollm2("wgpu", "5", extra))
}

fn u(v: &serde_json::Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("{v} is not a number"))
}

/// The plan's device bytes where they are host RAM (the CPU backends, a CPU renderer), else 0.
fn device_bytes_in_ram(plan: &serde_json::Value) -> u64 {
    if plan["device_in_host_memory"] == true {
        u(&plan["peak_device_bytes"])
    } else {
        0
    }
}

fn tier<'a>(plan: &'a serde_json::Value, name: &str) -> &'a serde_json::Value {
    plan["tiers"]
        .as_array()
        .expect("tiers")
        .iter()
        .find(|t| t["name"] == name)
        .unwrap_or_else(|| panic!("no {name} tier in {plan}"))
}

/// On a GPU backend (wgpu) all three tiers: groups the device budget does not hold stay in host
/// memory after their first read, as far as the host budget allows, and the rest stream from
/// the source; after the first token only the source tier is read from the source, and the
/// bytes per step from each equal the plan's. Tokens equal the resident run's, and peak RSS
/// stays within the plan (on lavapipe, with its device memory as the host RAM it is).
#[test]
fn three_tiers_on_wgpu_move_the_planned_bytes() {
    if nibble_tests::wgpu_or_absent("three tiers on wgpu").is_none() {
        return;
    }
    let resident = run_wgpu(&[]);
    assert_eq!(u(&resident["plan"]["streamed_groups"]), 0);
    let mem = device_130mib("4MiB");
    // Everything the device does not hold fits the host tier.
    let all = run_wgpu(&[&mem[..], &["--host-budget", "1TiB"]].concat());
    // A host budget that holds about half of those groups besides the process, the buffers and
    // the device memory where it is RAM (lavapipe).
    let host = half_the_host_tier(&all);
    let three = run_wgpu(&[&mem[..], &["--host-budget", &host.to_string()]].concat());
    let plan = &three["plan"];
    let (h, s) = (tier(plan, "host"), tier(plan, "source"));
    assert!(
        !h["groups"].as_array().expect("groups").is_empty()
            && !s["groups"].as_array().expect("groups").is_empty()
            && !tier(plan, "device")["groups"]
                .as_array()
                .expect("groups")
                .is_empty(),
        "all three tiers in use with a {host} B host budget: {plan}"
    );
    let src: Vec<u64> = three["bytes_source_per_step"]
        .as_array()
        .expect("source per step")
        .iter()
        .map(u)
        .collect();
    let hst: Vec<u64> = three["bytes_host_per_step"]
        .as_array()
        .expect("host per step")
        .iter()
        .map(u)
        .collect();
    let (s_bytes, h_bytes) = (u(&s["bytes_per_step"]), u(&h["bytes_per_step"]));
    assert_eq!(u(&plan["source_bytes_per_step"]), s_bytes);
    // wgpu uploads from plain host memory (CUDA's tier is pinned); no host tier, no memory.
    assert_eq!(three["host_tier_memory"], "host memory");
    assert!(resident["host_tier_memory"].is_null());
    // The first pass reads both tiers from the source; later ones the source tier only.
    assert_eq!((src[0], hst[0]), (s_bytes + h_bytes, 0), "first step");
    for (i, (a, b)) in src.iter().zip(&hst).enumerate().skip(1) {
        assert_eq!((*a, *b), (s_bytes, h_bytes), "step {i}");
    }
    // Measured where the reads happen: the host tier's groups were read from the source once.
    let totals = &three["bytes_read_totals"];
    let passes = src.len() as u64;
    assert!(
        u(&totals["source"]) >= h_bytes + s_bytes * passes
            && u(&totals["source"]) <= h_bytes + s_bytes * passes + 8 * MIB,
        "source reads {} for {passes} passes of {s_bytes} + the host tier's {h_bytes} once",
        totals["source"]
    );
    for r in [&all, &three] {
        assert_eq!(
            r["tokens"], resident["tokens"],
            "tokens equal the resident run's"
        );
    }
    within_plan(
        "SmolLM2 with three tiers on wgpu",
        &three,
        plan,
        u(&three["rss_max_bytes"]),
    );
}

/// Layers streamed from the source on wgpu, with a host budget that leaves almost no room for a
/// host tier (which would hide the loader's transients): peak RSS stays within the plan. Dense
/// weights (the embedding, resident in the arena) reach a device backend through host copies
/// made a piece at a time; made a slot at a time they peaked 30 MiB over the plan here with
/// 16 MiB slots.
#[test]
fn a_source_tier_on_wgpu_stays_within_the_plan() {
    if nibble_tests::wgpu_or_absent("a source tier on wgpu").is_none() {
        return;
    }
    let mem = device_130mib("16MiB");
    let all = run_wgpu(&[&mem[..], &["--host-budget", "1TiB"]].concat());
    // 3 MiB for the process's variation between runs: at most a group or so in the host tier.
    let host = host_budget_with_a_tier_of(&all, 3 * MIB);
    let src = run_wgpu(&[&mem[..], &["--host-budget", &host.to_string()]].concat());
    let plan = &src["plan"];
    assert!(
        u(&tier(plan, "host")["bytes"]) <= 4 * MIB && u(&tier(plan, "source")["bytes"]) > 0,
        "streamed from the source with a {host} B host budget: {plan}"
    );
    assert_eq!(src["tokens"], all["tokens"]);
    within_plan(
        "SmolLM2 streamed from the source on wgpu",
        &src,
        plan,
        u(&src["rss_max_bytes"]),
    );
}

/// A host budget for the run `all` that holds half of its host tier.
fn half_the_host_tier(all: &serde_json::Value) -> u64 {
    let held = u(&tier(&all["plan"], "host")["bytes"]);
    host_budget_with_a_tier_of(all, held / 2)
}

/// A host budget for the run `all` (whose host tier holds every group the device does not):
/// what it held when it planned, its buffers, its device memory where that is host RAM, and
/// `tier_bytes` for the host tier.
fn host_budget_with_a_tier_of(all: &serde_json::Value, tier_bytes: u64) -> u64 {
    let plan = &all["plan"];
    let held = u(&tier(plan, "host")["bytes"]);
    assert!(held > 0 && u(&tier(plan, "source")["bytes"]) == 0, "{plan}");
    let device = device_bytes_in_ram(plan);
    u(&all["budget"]["rss_at_plan_bytes"]) + u(&plan["peak_host_bytes"]) - held
        + device
        + tier_bytes
}

/// SmolLM2's run options for a 130 MiB device budget (most layers off the device) and a ring of
/// two `slot_size` slots.
fn device_130mib(slot_size: &str) -> [&str; 6] {
    [
        "--device-budget",
        "130MiB",
        "--slots",
        "2",
        "--slot-size",
        slot_size,
    ]
}

/// A DiT on wgpu with all three tiers: its latents equal the resident run's, every step after
/// the first reads only the source tier from the source, and peak RSS stays within the plan
/// (lavapipe's device memory counted as the host RAM it is).
#[test]
fn three_tiers_on_wgpu_for_a_dit() {
    if nibble_tests::wgpu_or_absent("three tiers on wgpu").is_none() {
        return;
    }
    let tmp = tempfile::tempdir().expect("tmp");
    let dit = tmp.path().join("dit");
    nibble_tests::synth(
        std::path::Path::new(env!("CARGO_BIN_EXE_nibble")),
        "dit",
        "24MiB",
        9,
        &dit,
    );
    let run = |name: &str, extra: &[&str]| -> (serde_json::Value, Vec<u8>) {
        let out = tmp.path().join(name);
        let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .args(["run", "--model"])
            .arg(&dit)
            .args([
                "--backend",
                "wgpu",
                "--steps",
                "3",
                "--height",
                "2",
                "--width",
                "2",
            ])
            .args([
                "--text-len",
                "2",
                "--json",
                "--slots",
                "2",
                "--slot-size",
                "4MiB",
            ])
            .args(extra)
            .arg("--out")
            .arg(&out)
            .output()
            .expect("run");
        let v = json(&o);
        (v["summary"].clone(), std::fs::read(&out).expect("latents"))
    };
    let (resident, latents) = run("resident.safetensors", &[]);
    assert_eq!(u(&resident["plan"]["streamed_groups"]), 0, "{resident}");
    // Half the resident device memory, the rest in a host tier that holds it all.
    let device = (u(&resident["plan"]["peak_device_bytes"]) / 2).to_string();
    let (all, _) = run(
        "all.safetensors",
        &["--device-budget", &device, "--host-budget", "1TiB"],
    );
    let host = half_the_host_tier(&all).to_string();
    let (three, three_latents) = run(
        "three.safetensors",
        &["--device-budget", &device, "--host-budget", &host],
    );
    let plan = &three["plan"];
    for t in ["device", "host", "source"] {
        assert!(
            !tier(plan, t)["groups"]
                .as_array()
                .expect("groups")
                .is_empty(),
            "the {t} tier holds groups with a {host} B host budget: {plan}"
        );
    }
    let (s_bytes, h_bytes) = (
        u(&tier(plan, "source")["bytes_per_step"]),
        u(&tier(plan, "host")["bytes_per_step"]),
    );
    let per_step = |k: &str| -> Vec<u64> {
        three[k]
            .as_array()
            .expect("per step")
            .iter()
            .map(u)
            .collect()
    };
    let (src, hst) = (
        per_step("bytes_source_per_step"),
        per_step("bytes_host_per_step"),
    );
    assert_eq!((src[0], hst[0]), (s_bytes + h_bytes, 0), "first step");
    for (i, (a, b)) in src.iter().zip(&hst).enumerate().skip(1) {
        assert_eq!((*a, *b), (s_bytes, h_bytes), "step {i}");
    }
    assert!(
        three_latents == latents,
        "the three-tier run's latents equal the resident run's"
    );
    within_plan("DiT, three tiers", &three, plan, u(&three["rss_max_bytes"]));
}

/// Peak RSS within the process's memory when it planned plus the plan's host bytes (plus its
/// device bytes where they are host RAM: the CPU backends, a CPU renderer), + 16 MiB.
fn within_plan(what: &str, v: &serde_json::Value, plan: &serde_json::Value, peak: u64) {
    let at_plan = u(&v["budget"]["rss_at_plan_bytes"]);
    let device = device_bytes_in_ram(plan);
    let predicted = at_plan + u(&plan["peak_host_bytes"]) + device;
    println!("{what}: peak RSS {peak} B, predicted {predicted} B");
    assert!(
        peak <= predicted + 16 * MIB,
        "{what}: peak RSS {peak} over the predicted {predicted} + 16 MiB"
    );
    assert!(u(&plan["streamed_groups"]) > 0, "{what} streams: {plan}");
}

/// The plan is a contract for RSS: the run's peak stays within the process's memory when it
/// planned plus the plan's host bytes (plus its device bytes, host memory on the CPU backend),
/// with 16 MiB of slack, for a language model, a DiT and an encoder whose layers stream.
#[test]
fn peak_rss_stays_within_the_plan_for_every_run_kind() {
    let check = within_plan;
    let llm = json(&run(&["--device-budget", "80MiB"]));
    check("SmolLM2", &llm, &llm["plan"], u(&llm["rss_max_bytes"]));
    let tmp = tempfile::tempdir().expect("tmp");
    let dit = tmp.path().join("dit");
    nibble_tests::synth(
        std::path::Path::new(env!("CARGO_BIN_EXE_nibble")),
        "dit",
        "64MiB",
        5,
        &dit,
    );
    let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["run", "--model"])
        .arg(&dit)
        .args([
            "--backend",
            "cpu",
            "--steps",
            "4",
            "--json",
            "--device-budget",
            "40MiB",
        ])
        .args(["--slots", "2", "--slot-size", "4MiB"])
        .output()
        .expect("run");
    let v = json(&o);
    let s = &v["summary"];
    check("DiT", s, &s["plan"], u(&s["rss_max_bytes"]));
    // A sentence embedding (BERT), its layers streamed: one pass reads the planned bytes.
    let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(["run", "--model"])
        .arg(nibble_tests::fixture("minilm-nf4/model"))
        .args(["--prompt", "memory planned up front", "--backend", "cpu"])
        .args(["--json", "--device-budget", "4MiB"])
        .args(["--slots", "2", "--slot-size", "4MiB"])
        .output()
        .expect("run");
    let v = json(&o);
    check("MiniLM", &v, &v["plan"], u(&v["rss_max_bytes"]));
    assert_eq!(
        v["bytes_source_per_step"][0], v["plan"]["source_bytes_per_step"],
        "{v}"
    );
}

/// On a CPU renderer (lavapipe) the device's memory is the process's RAM: `--device-budget auto`
/// is capped by the host budget less the process and the plan's host buffers, the plan counts
/// the device bytes as host memory, and the run that streams what the cap leaves out gives the
/// resident run's tokens within the host budget.
#[test]
fn a_cpu_renderers_auto_device_budget_fits_the_host_budget() {
    let Some(backend) = nibble_tests::wgpu_or_absent("a CPU renderer's auto budget") else {
        return;
    };
    if !backend.is_software() {
        println!("the wgpu adapter is a GPU: its memory is not this process's RAM; not run");
        return;
    }
    let ring = ["--slots", "2", "--slot-size", "4MiB"];
    let resident = run_wgpu(&ring);
    let plan = &resident["plan"];
    assert_eq!(plan["device_in_host_memory"], true, "{plan}");
    assert_eq!(u(&plan["streamed_groups"]), 0, "{plan}");
    // Room for the process, the buffers and about 90% of the resident device memory.
    let device = u(&plan["peak_device_bytes"]);
    let host =
        u(&resident["budget"]["rss_at_plan_bytes"]) + u(&plan["peak_host_bytes"]) + device * 9 / 10;
    let capped = run_wgpu(&[&ring[..], &["--host-budget", &host.to_string()]].concat());
    let plan = &capped["plan"];
    let note = capped["budget"]["note"].as_str().unwrap_or("");
    assert!(note.contains("capped at"), "{note}");
    assert!(
        u(&plan["streamed_groups"]) > 0 && u(&plan["peak_device_bytes"]) < device,
        "{plan}"
    );
    assert!(
        u(&capped["budget"]["rss_at_plan_bytes"])
            + u(&plan["peak_host_bytes"])
            + u(&plan["peak_device_bytes"])
            <= host,
        "the plan with its device memory fits the host budget {host}: {plan}"
    );
    assert_eq!(capped["tokens"], resident["tokens"]);
}
