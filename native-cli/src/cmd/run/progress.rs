//! A pipeline run's progress, for every pipeline kind: each phase's start and end (wall time,
//! bytes streamed, its own peak RSS) and each denoising step (time, bytes, stall, RSS) printed
//! unless quiet, and kept for `--json`.

use nibble_core::models::pipeline::Event;
use nibble_core::plan::fmt_bytes;
use serde_json::json;

/// What a run reported so far.
pub struct Progress {
    quiet: bool,
    t_run: std::time::Instant,
    /// Per phase: name, ms, bytes streamed, peak RSS (or `cached`).
    pub phases: Vec<serde_json::Value>,
    /// Per denoising step: [`super::dit::step_row`].
    pub steps: Vec<serde_json::Value>,
    /// RSS before the first phase allocated.
    pub baseline: u64,
    /// The largest phase's peak RSS.
    pub peak: u64,
}

impl Progress {
    /// Starts measuring: the process's own memory before the first phase allocates (binary,
    /// libraries, driver state, the opened indexes), which each phase's plan comes on top of.
    pub fn start(quiet: bool) -> Self {
        nibble_core::io::machine::reset_peak_rss();
        let baseline = nibble_core::io::machine::rss_bytes().unwrap_or(0);
        Progress {
            quiet,
            t_run: std::time::Instant::now(),
            phases: Vec::new(),
            steps: Vec::new(),
            baseline,
            peak: baseline,
        }
    }

    /// Takes one event of the run.
    pub fn on(&mut self, e: Event<'_>) {
        let quiet = self.quiet;
        match e {
            Event::PhaseStart { phase } => {
                // Each phase's peak is its own.
                nibble_core::io::machine::reset_peak_rss();
                if !quiet {
                    eprintln!("{phase} ...");
                }
            }
            Event::Cached { phase } => {
                if !quiet {
                    eprintln!("{phase}: outputs from the embedding cache");
                }
                self.phases
                    .push(json!({"phase": phase, "cached": true, "ms": 0.0, "bytes_streamed": 0}));
            }
            Event::Step {
                step,
                steps: n,
                info,
            } => {
                if !quiet {
                    let done = self.t_run.elapsed().as_secs_f64();
                    eprintln!(
                        "  {} step {step:>3}/{n}: {:>7.0} ms, {} streamed, stall {:.0} ms, RSS {} \
                         ({:.0} s in)",
                        bar(step, n),
                        info.wall.as_secs_f64() * 1e3,
                        fmt_bytes(info.stats.stream.bytes),
                        info.stats.stream.stall.as_secs_f64() * 1e3,
                        fmt_bytes(info.rss_bytes),
                        done
                    );
                }
                self.steps.push(super::dit::step_row(info));
            }
            Event::Frames {
                first,
                total,
                width,
                height,
                rgb,
            } => {
                let n = rgb.len() / (width * height * 3).max(1);
                if !quiet {
                    eprintln!(
                        "  {} frames {}-{} of {total} decoded, RSS {}",
                        bar(first + n, total),
                        first + 1,
                        first + n,
                        fmt_bytes(nibble_core::io::machine::rss_bytes().unwrap_or(0))
                    );
                }
            }
            Event::PhaseDone {
                phase,
                ms,
                bytes_streamed,
            } => {
                let rss = nibble_core::io::machine::peak_rss_bytes().unwrap_or(0);
                self.peak = self.peak.max(rss);
                if !quiet {
                    eprintln!(
                        "{phase} done in {ms:.0} ms, {} streamed, peak RSS {}",
                        fmt_bytes(bytes_streamed),
                        fmt_bytes(rss)
                    );
                }
                self.phases.push(json!({"phase": phase, "ms": ms,
                    "bytes_streamed": bytes_streamed, "peak_rss_bytes": rss}));
            }
        }
    }
}

/// A progress bar of `done` of `total`.
pub fn bar(done: usize, total: usize) -> String {
    let w = 24;
    let filled = (done * w).div_ceil(total.max(1)).min(w);
    format!("[{}{}]", "#".repeat(filled), "-".repeat(w - filled))
}
