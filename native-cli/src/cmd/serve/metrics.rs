//! The API server's counters (the engine's and the requests'), served at `GET /metrics` in
//! Prometheus' text format.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Mutex;

use nibble_core::models::llama::engine::BatchCounters;

/// Requests answered; with the engine's counters ([`BatchCounters`]) what `/metrics` reads.
#[derive(Debug, Default)]
pub(super) struct Metrics {
    /// Requests answered, by (endpoint, status).
    requests: Mutex<BTreeMap<(String, u16), u64>>,
}

impl Metrics {
    /// Counts one answered request.
    pub fn request(&self, endpoint: &str, status: u16) {
        if let Ok(mut m) = self.requests.lock() {
            *m.entry((endpoint.to_string(), status)).or_default() += 1;
        }
    }

    /// The Prometheus text exposition of the engine's counters `c` and the requests.
    pub fn render(&self, c: &BatchCounters) -> String {
        let mut s = String::new();
        let mut metric = |name: &str, kind: &str, help: &str, v: f64| {
            let _ = writeln!(s, "# HELP nibble_{name} {help}");
            let _ = writeln!(s, "# TYPE nibble_{name} {kind}");
            let _ = writeln!(s, "nibble_{name} {v}");
        };
        let g = |a: &AtomicU64| a.load(Relaxed) as f64;
        metric(
            "prompt_tokens_total",
            "counter",
            "Prompt tokens of admitted requests.",
            g(&c.prompt_tokens),
        );
        metric(
            "completion_tokens_total",
            "counter",
            "Tokens generated.",
            g(&c.completion_tokens),
        );
        metric(
            "queue_depth",
            "gauge",
            "Requests waiting for a sequence slot.",
            g(&c.queue_depth),
        );
        metric(
            "active_sequences",
            "gauge",
            "Sequences holding a KV cache slot.",
            g(&c.active),
        );
        metric(
            "decode_passes_total",
            "counter",
            "Decode passes over the weights.",
            g(&c.decode_passes),
        );
        metric(
            "decode_rows_total",
            "counter",
            "Sequences computed by decode passes (rows / passes = mean batch size).",
            g(&c.decode_rows),
        );
        metric(
            "batch_size",
            "gauge",
            "Sequences in the last decode pass.",
            g(&c.batch_size),
        );
        metric(
            "batch_size_max",
            "gauge",
            "Most sequences in one decode pass.",
            g(&c.batch_size_max),
        );
        metric(
            "prefill_passes_total",
            "counter",
            "Prefill passes (one prompt chunk each).",
            g(&c.prefill_passes),
        );
        metric(
            "mixed_passes_total",
            "counter",
            "Mixed passes (prompt tokens of several sequences beside decoded ones).",
            g(&c.mixed_passes),
        );
        metric(
            "bytes_streamed_total",
            "counter",
            "Weight bytes read from the source for streamed groups.",
            g(&c.bytes_streamed),
        );
        metric(
            "bytes_host_tier_total",
            "counter",
            "Weight bytes uploaded from the host tier.",
            g(&c.bytes_host_tier),
        );
        metric(
            "step_seconds_total",
            "counter",
            "Seconds spent in passes over the weights.",
            g(&c.step_micros) / 1e6,
        );
        metric(
            "steps_total",
            "counter",
            "Passes over the weights.",
            g(&c.steps),
        );
        metric(
            "sequences_finished_total",
            "counter",
            "Sequences ended by a stop or their length.",
            g(&c.finished),
        );
        metric(
            "sequences_cancelled_total",
            "counter",
            "Sequences freed because the client went away.",
            g(&c.cancelled),
        );
        metric(
            "sequences_failed_total",
            "counter",
            "Sequences ended by an error.",
            g(&c.failed),
        );
        metric(
            "requests_rejected_total",
            "counter",
            "Requests refused with 503 (queue full).",
            g(&c.rejected),
        );
        let _ = writeln!(
            s,
            "# HELP nibble_requests_total Requests answered, by endpoint and status."
        );
        let _ = writeln!(s, "# TYPE nibble_requests_total counter");
        if let Ok(m) = self.requests.lock() {
            for ((endpoint, status), n) in m.iter() {
                let _ = writeln!(
                    s,
                    "nibble_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
                );
            }
        }
        s
    }
}
