//! The run prelude every `nibble run` kind shares, and `nibble plan`: what `nibble run` with the
//! same options would plan, printed without reading a weight byte: where the budgets came from,
//! each phase's plan with its tiers, and the smallest device budget each phase runs with (every
//! group streamed).

use anyhow::Result;
use nibble_core::backend::Backend;
use nibble_core::exec::ExecOptions;
use nibble_core::graph::Graph;
use nibble_core::io::model::ModelIndex;
use nibble_core::plan::budget::{BudgetNote, PhaseBudget};
use nibble_core::plan::{fmt_bytes, MemoryPlan};
use serde_json::json;

use super::options::RunArgs;

/// The prelude of a run of one phase (`phase`: its name, of `graph` on `model`): core's budget
/// decision; with `nibble plan`, the plan printed and `None` (nothing allocated or read).
pub(super) fn prelude<B: Backend>(
    o: &RunArgs,
    backend: &mut B,
    label: &str,
    phase: &str,
    graph: &Graph,
    model: &ModelIndex,
) -> Result<Option<(ExecOptions, BudgetNote)>> {
    let d = super::options::decide(&o.memory, backend, &[(graph, model)])?;
    if o.plan_only {
        let phases: Vec<_> = d.phases.iter().map(|p| (phase, p.clone())).collect();
        print(o, label, &d.note, &phases)?;
        return Ok(None);
    }
    Ok(Some((ExecOptions::decided(&d, 2), d.note)))
}

/// What a run prints once its executor is planned and allocated, before its first step: the
/// backend, where the budgets came from and the plan.
pub(super) fn announce(o: &RunArgs, label: &str, note: &BudgetNote, plan: &MemoryPlan) {
    if !o.json {
        eprintln!("backend {label}");
        eprintln!("{}", note.note);
        eprint!("{}", plan.explain());
    }
}

/// `nibble plan` on a pipeline: the budgets decided from the graphs that size them, what the
/// budgets decide settled (a VAE's tiling), every phase planned as it will run and printed.
pub(super) fn print_pipeline<P: nibble_core::models::pipeline::Pipeline, B: Backend>(
    o: &RunArgs,
    label: &str,
    pipe: &P,
    prepared: &mut P::Prepared,
    backend: &mut B,
) -> Result<()> {
    let machine = nibble_core::plan::budget::Machine::measure();
    let d = {
        let phases = pipe.budget_graphs(prepared)?;
        let graphs: Vec<_> = phases.iter().map(|(_, g, m)| (g, *m)).collect();
        nibble_core::plan::budget::decide(&o.memory.request(), &machine, backend, &graphs)?
    };
    pipe.settle(prepared, backend, ExecOptions::decided(&d, 2))?;
    let phases = pipe.graphs(prepared)?;
    let graphs: Vec<_> = phases.iter().map(|(_, g, m)| (g, *m)).collect();
    let planned = nibble_core::plan::budget::phase_budgets(
        d.budgets,
        d.stream_all,
        &machine,
        backend,
        &graphs,
    )?;
    let named: Vec<_> = phases.iter().map(|(n, ..)| *n).zip(planned).collect();
    print(o, label, &d.note, &named)
}

/// Prints each phase's plan (`phases`: name and its plan under the decided budgets).
pub(super) fn print(
    o: &RunArgs,
    label: &str,
    note: &BudgetNote,
    phases: &[(&str, PhaseBudget)],
) -> Result<()> {
    let mut rows = Vec::new();
    let mut text = format!("{}\nbackend {label}\n{}\n", o.model, note.note);
    for (name, p) in phases {
        let (least, resident) = (p.min_device_bytes, p.resident_device_bytes);
        match &p.plan {
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
                rows.push(json!({"phase": name, "error": e,
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
