//! The CPU kernels through the binary: `bench kernels`' roofline and its refusals, and every
//! instruction set the CPU has (forced by `NIBBLE_CPU_ISA`) giving the same logits bit for bit.

use std::process::{Command, Output};

fn nibble(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_nibble"))
        .args(args)
        .output()
        .expect("run nibble")
}

/// Whether a CUDA device is usable here (the CLI's CUDA refusals are tested only where it is not).
fn nibble_cuda_present() -> bool {
    nibble_cuda::CudaBackend::new().is_ok()
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

#[test]
fn bench_kernels_prints_a_roofline_on_the_cpu() {
    let o = nibble(&["bench", "kernels", "--backend", "cpu", "--quick", "--json"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).expect("json");
    let r = &v["roofline"];
    assert!(r["stream_gb_s"].as_f64().is_some_and(|g| g > 0.0), "{r}");
    assert!(
        r["compute_roof"]["gflop_s"]
            .as_f64()
            .is_some_and(|g| g > 0.0),
        "{r}"
    );
    // Each kernel under the roof its intensity puts it under (the peaks of a debug build are
    // not a release build's, so the placement is checked, not which side a kernel falls on).
    let (other_roof, gemm_roof, stream) = (
        r["compute_roof"]["gflop_s"].as_f64().expect("roof"),
        r["gemm_roof"]["gflop_s"].as_f64().expect("gemm roof"),
        r["stream_gb_s"].as_f64().expect("stream"),
    );
    for k in v["kernels"].as_array().expect("kernels") {
        // The GEMM (a 4-bit linear of more than 4 rows) and attention run the GEMM's
        // micro-kernel, under its width's roof; the rest under AVX2's.
        let name = k["kernel"].as_str().expect("kernel");
        let rows: usize = name
            .strip_prefix("nf4 linear ")
            .and_then(|r| r.split('x').next())
            .and_then(|r| r.parse().ok())
            .unwrap_or(0);
        let roof = if name.starts_with("attention") || rows > 4 {
            gemm_roof
        } else {
            other_roof
        };
        let (gflop_s, gb_s) = (
            k["gflop_s"].as_f64().expect("f"),
            k["gb_s"].as_f64().expect("b"),
        );
        let (want, frac) = if gflop_s / gb_s < roof / stream {
            ("memory", gb_s / stream)
        } else {
            ("compute", gflop_s / roof)
        };
        assert_eq!(k["bound"], want, "{k}");
        let of = k["of_roof"].as_f64().expect("of_roof");
        assert!((of - frac).abs() <= 1e-6 * frac.max(1.0) && of > 0.0, "{k}");
    }
}

#[test]
fn bench_kernels_refuses_unknown_and_absent_backends_clearly() {
    // Where no CUDA driver is installed (this project's CI), the CUDA backend says so; on a
    // machine with one this half is skipped.
    if !nibble_cuda_present() {
        let o = nibble(&["bench", "kernels", "--backend", "cuda"]);
        assert_eq!(o.status.code(), Some(1));
        assert!(
            stderr(&o).contains("no CUDA driver found"),
            "{}",
            stderr(&o)
        );
    }
    let o = nibble(&["bench", "kernels", "--backend", "tpu"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("invalid value 'tpu'")
            && ["cpu", "cpu-ref", "wgpu", "cuda"]
                .iter()
                .all(|b| stderr(&o).contains(b)),
        "{}",
        stderr(&o)
    );
}

#[test]
fn every_gemm_instruction_set_gives_the_same_logits_bit_for_bit() {
    // The prompt (more rows than the GEMV takes) runs every linear on the blocked GEMM, the
    // decoded token on the GEMV (where its shapes fit); each instruction set this CPU has,
    // forced by NIBBLE_CPU_ISA, must write the same bytes.
    let dir = nibble_tests::fixtures_dir().join("tiny-llama-nf4");
    let exp = nibble_core::io::model::ModelIndex::open(&dir.join("expected.safetensors"))
        .expect("expected");
    let b = exp
        .read_bytes(exp.require("prompt_ids").expect("prompt_ids"))
        .expect("read");
    let prompt: Vec<String> = b
        .chunks_exact(8)
        .map(|c| i64::from_le_bytes(c.try_into().expect("8")).to_string())
        .collect();
    assert!(prompt.len() > nibble_core::backend::cpu::GEMV_MAX_ROWS);
    let tmp = tempfile::tempdir().expect("tmp");
    let model = dir.join("model");
    let mut files = Vec::new();
    // Every set present (the GEMV follows the GEMM's).
    let mut sets: Vec<(&str, String)> = Vec::new();
    for isa in nibble_core::backend::cpu::gemm::Isa::all_present() {
        sets.push((isa.name(), format!("GEMM {0}, GEMV {0}", isa.name())));
    }
    for (env, line) in sets {
        let out = tmp.path().join(format!("{env}.safetensors"));
        let o = Command::new(env!("CARGO_BIN_EXE_nibble"))
            .env("NIBBLE_CPU_ISA", env)
            .args([
                "run",
                "--model",
                model.to_str().expect("utf8"),
                "--prompt-ids",
            ])
            .arg(prompt.join(","))
            .args(["--max-tokens", "2", "--backend", "cpu", "--logits-out"])
            .arg(&out)
            .output()
            .expect("run nibble");
        assert!(o.status.success(), "{}", stderr(&o));
        assert!(
            stderr(&o).contains(&line),
            "the backend line names the forced instruction set: {}",
            stderr(&o)
        );
        files.push((env, std::fs::read(&out).expect("logits")));
    }
    for (name, bytes) in &files[1..] {
        assert!(bytes == &files[0].1, "{name} differs from {}", files[0].0);
    }
}
