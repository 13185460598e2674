//! `nibble plan`: what `nibble run` with the same options would plan, printed without reading a
//! weight byte: where the budgets came from, each phase's plan with its tiers, and the smallest
//! device budget each phase runs with (every group streamed).

use anyhow::Result;
use nibble_core::backend::Backend;
use nibble_core::exec::{ExecOptions, Executor};
use nibble_core::graph::Graph;
use nibble_core::io::model::ModelIndex;
use nibble_core::plan::fmt_bytes;
use serde_json::json;

use super::options::{BudgetNote, RunArgs};

/// Prints the plan of each phase (`phases`: name, graph, model) for `opts`.
pub(super) fn print<B: Backend>(
    o: &RunArgs,
    backend: &mut B,
    label: &str,
    note: &BudgetNote,
    opts: ExecOptions,
    phases: &[(&str, &Graph, &ModelIndex)],
) -> Result<()> {
    let mut rows = Vec::new();
    let mut text = format!("{}\nbackend {label}\n{}\n", o.model, note.note);
    for (name, g, m) in phases {
        let least = nibble_core::plan::min_device_bytes(g, m, backend)?;
        let resident = nibble_core::plan::resident_device_bytes(g, m, backend)?;
        match Executor::plan_only(g, m, backend, opts) {
            Ok(plan) => {
                text.push_str(&format!(
                    "phase {name}: smallest device budget {} (every group streamed), every \
                     weight resident {}; predicted host peak {} (the process now {} + the \
                     plan's host {}{})\n",
                    fmt_bytes(least),
                    fmt_bytes(resident),
                    fmt_bytes(note.rss_at_plan + plan.host_bytes_with_device()),
                    fmt_bytes(note.rss_at_plan),
                    fmt_bytes(plan.peak_host_bytes),
                    if plan.device_in_host_memory {
                        format!(
                            " + device {}, host memory here",
                            fmt_bytes(plan.peak_device_bytes)
                        )
                    } else {
                        String::new()
                    }
                ));
                text.push_str(&plan.explain());
                rows.push(json!({"phase": name, "plan": plan.to_json(),
                    "min_device_bytes": least, "resident_device_bytes": resident}));
            }
            Err(e) => {
                text.push_str(&format!(
                    "phase {name}: does not run with these budgets: {e}\n  smallest device \
                     budget {}, every weight resident {}\n",
                    fmt_bytes(least),
                    fmt_bytes(resident)
                ));
                rows.push(json!({"phase": name, "error": e.to_string(),
                    "min_device_bytes": least, "resident_device_bytes": resident}));
            }
        }
    }
    if o.json {
        crate::output::write_stdout(
            &(json!({"model": o.model, "backend": label, "budget": note.json(), "phases": rows})
                .to_string()
                + "\n"),
        )?;
    } else {
        crate::output::write_stdout(&text)?;
    }
    Ok(())
}
