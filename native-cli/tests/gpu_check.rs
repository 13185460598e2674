//! `scripts/gpu-check.sh` must not waste a GPU machine's time: its preflight runs first, takes
//! seconds, and on a machine without what it needs stops the whole check with exit 2, naming
//! what is missing, before any step (and before it looks for the bundle).

use std::process::Command;
use std::time::{Duration, Instant};

fn gpu_present() -> bool {
    Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|o| o.status.success() && !o.stdout.is_empty())
}

#[test]
fn the_preflight_refuses_a_machine_without_a_gpu_at_once() {
    let repo = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for args in [vec!["--preflight"], vec![]] {
        let out = tempfile::tempdir().expect("tmp");
        let t0 = Instant::now();
        let o = Command::new("bash")
            .arg(repo.join("scripts/gpu-check.sh"))
            .args(&args)
            .arg(out.path())
            .output()
            .expect("run gpu-check.sh");
        let took = t0.elapsed();
        let text =
            String::from_utf8_lossy(&o.stdout).to_string() + &String::from_utf8_lossy(&o.stderr);
        if gpu_present() {
            // A GPU machine: the preflight's own lines, whatever it finds.
            assert!(text.contains("GPU") || text.contains("gpu"), "{text}");
            return;
        }
        assert_eq!(o.status.code(), Some(2), "{args:?}: {text}");
        assert!(took < Duration::from_secs(30), "{args:?}: took {took:?}");
        assert!(
            text.contains("preflight failed, nothing else was run") && text.contains("nvidia-smi"),
            "{args:?}: {text}"
        );
        // No step ran: no log, no bench output; the summary says why.
        assert!(
            !out.path().join("gpu-check.log").exists(),
            "{args:?}: a step ran"
        );
        let summary = std::fs::read_to_string(out.path().join("summary.md")).expect("summary.md");
        assert!(summary.contains("preflight failed"), "{summary}");
        assert!(summary.contains("missing nvidia-smi"), "{summary}");
    }
}
