//! The budget decision: how much memory a run gets. One function, [`decide`], takes what the
//! user asked for ([`BudgetRequest`]: sizes or `auto`, `--stream-all`, the ring), the backend,
//! the machine (read once, [`Machine`]) and the run's phase graphs, and returns the budgets, the
//! tiers, the ring and a note that explains them, with each phase's plan under them. The CLI
//! (`run`, `plan`, `serve`, `demo`, `bench`) and the browser call it; none of them plans.
//!
//! Each phase gets one [`Planner`] (each quant state read once), made before the process is
//! measured so that the measure, and with it the predicted peak, includes the planner's memory.

use crate::backend::{Backend, DeviceInfo};
use crate::error::{Error, Result};
use crate::graph::Graph;
use crate::io::machine::HostMemory;
use crate::io::model::ModelIndex;

use super::{fmt_bytes, Budgets, MemoryPlan, Planner, Rules};

/// A host budget as the user gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Budget {
    /// Decided from the machine.
    Auto,
    /// This many bytes.
    Bytes(u64),
}

/// A device budget as the user gives it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceBudget {
    /// Every weight of the largest phase resident, capped by what the device (or, where device
    /// memory is host memory, the host budget) holds.
    Auto,
    /// This many bytes.
    Bytes(u64),
    /// The least that runs every phase: every group streamed (the browser's "min").
    Least,
    /// Every weight of the largest phase resident, uncapped (the browser's "resident").
    Resident,
}

impl std::fmt::Display for Budget {
    /// As the command line takes it: `auto` or a number of bytes.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Budget::Auto => f.write_str("auto"),
            Budget::Bytes(n) => write!(f, "{n}"),
        }
    }
}

impl From<Budget> for DeviceBudget {
    fn from(b: Budget) -> Self {
        match b {
            Budget::Auto => DeviceBudget::Auto,
            Budget::Bytes(n) => DeviceBudget::Bytes(n),
        }
    }
}

/// What a run asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BudgetRequest {
    /// The device budget.
    pub device: DeviceBudget,
    /// The host budget.
    pub host: Budget,
    /// Ring slots; `None`: auto (see [`decide`]).
    pub slots: Option<u64>,
    /// Bytes per ring slot; `None`: auto.
    pub slot_size: Option<u64>,
    /// Stream every weight group whatever the budget holds.
    pub stream_all: bool,
}

/// What the machine lets the process use, read once per run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Machine {
    /// Host memory available (MemAvailable capped by the cgroup's room), where known.
    pub host: Option<HostMemory>,
    /// The memory available now, bounding any one allocation (`None` where unknown).
    pub available: Option<u64>,
}

impl Machine {
    /// Reads `/proc/meminfo` and the cgroup files (nothing where there are none: the browser).
    pub fn measure() -> Self {
        Machine {
            host: crate::io::machine::host_memory(),
            available: crate::io::machine::available_memory_bytes(),
        }
    }

    /// A machine that tells nothing (the browser): no host budget, no allocation cap.
    pub fn unknown() -> Self {
        Machine {
            host: None,
            available: None,
        }
    }
}

/// Where a run's budgets came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BudgetNote {
    /// One line for the plan's printout.
    pub note: String,
    /// The process's RSS when the budgets were decided.
    pub rss_at_plan: u64,
    /// The host budget, where known.
    pub host_budget: Option<u64>,
    /// The device budget decided.
    pub device_budget: u64,
}

impl BudgetNote {
    /// As `--json` reports it.
    pub fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "note": self.note,
            "rss_at_plan_bytes": self.rss_at_plan,
            "host_budget_bytes": self.host_budget,
            "device_budget_bytes": self.device_budget,
        })
    }
}

/// One phase under the decided budgets.
#[derive(Debug, Clone)]
pub struct PhaseBudget {
    /// Its plan, or why the budgets do not run it.
    pub plan: std::result::Result<MemoryPlan, String>,
    /// The smallest device budget it runs with (every group streamed).
    pub min_device_bytes: u64,
    /// The device budget that keeps every group resident.
    pub resident_device_bytes: u64,
}

/// The decision: the budgets (ring and host tier included), whether every group streams, the
/// note, and each phase's plan under them.
#[derive(Debug, Clone)]
pub struct BudgetDecision {
    /// The budgets.
    pub budgets: Budgets,
    /// Every group streams whatever the budget holds.
    pub stream_all: bool,
    /// Where they came from.
    pub note: BudgetNote,
    /// Per phase graph, in the order given.
    pub phases: Vec<PhaseBudget>,
}

/// The staging ring: slots of a size.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Ring {
    slots: u64,
    slot_size: u64,
}

/// The ring nibble starts from where `--slots` or `--slot-size` is `auto`.
pub const AUTO_SLOTS: u64 = 4;
/// The slot size nibble starts from where `--slot-size` is `auto`.
pub const AUTO_SLOT_SIZE: u64 = 16 << 20;
/// An automatic ring grows to at most this many bytes, and slots.
const AUTO_RING_MAX: u64 = 1 << 30;
const AUTO_SLOTS_MAX: u64 = 256;
/// A ring that grows has slots of this size (where `--slot-size` is `auto`), and at least this
/// many (where `--slots` is).
const AUTO_GROWN_SLOT_SIZE: u64 = 32 << 20;
const AUTO_GROWN_SLOTS: u64 = 16;

/// The phases' planners, one per graph, and the machine.
struct Phases<'a> {
    planners: Vec<Planner>,
    machine: &'a Machine,
    req: &'a BudgetRequest,
}

impl Phases<'_> {
    /// Each phase's plan for these budgets (the planner's error as a string).
    fn plans(&self, b: Budgets) -> Vec<Result<MemoryPlan>> {
        self.planners
            .iter()
            .map(|p| {
                p.plan_within(b, self.req.stream_all, self.machine.available)
                    .map(|x| x.0)
            })
            .collect()
    }

    /// The budgets of the request with this ring and device budget (no host tier yet).
    fn budgets(&self, r: Ring, device_bytes: u64) -> Budgets {
        Budgets {
            device_bytes,
            ring_slots: r.slots,
            slot_bytes: r.slot_size,
            host_tier_bytes: 0,
        }
    }

    /// The largest group that `b` leaves streamed or in the host tier over every phase: the
    /// slots it takes, its bytes and its name.
    fn largest(&self, b: Budgets) -> Option<(u64, u64, String)> {
        let mut most: Option<(u64, u64, String)> = None;
        for p in &self.planners {
            if let Ok(Some(l)) =
                p.largest_streamed_group(b, self.req.stream_all, self.machine.available)
            {
                if most.as_ref().is_none_or(|x| (l.0, l.1) > (x.0, x.1)) {
                    most = Some(l);
                }
            }
        }
        most
    }
}

/// Decides a run's budgets for `graphs` (its phases, each with its model) on `backend`.
///
/// The device budget: the size given, or `auto`: every weight of the largest phase resident,
/// capped on a backend whose device memory is host memory (the CPU backends) by the host budget
/// less the ring and the process's memory; on a device that tells its free memory, by that less
/// a margin of a tenth of its total (at least 256 MiB); on one that tells limits only (a wgpu
/// adapter), by a stated fraction of its allocation limit. Each phase's plan must then fit the
/// host budget with the process's memory (its device bytes count too where they are host
/// memory); a run that would not is refused before anything is allocated or read. Where host
/// and device memory differ, what the host budget holds besides becomes the host tier.
///
/// The ring: with `slots` or `slot_size` `None` it is 4 x 16 MiB unless a group that the plan
/// streams (or keeps in the host tier, which uploads through the ring too) takes more slots:
/// then it grows to 16 slots of 32 MiB, or more to hold the largest such group, so that reads
/// run on while groups compute instead of the disk idling once a small ring is full, within an
/// eighth of the host budget left after the process, 1 GiB and 256 slots; the budgets are then
/// decided again with it.
pub fn decide<B: Backend + ?Sized>(
    req: &BudgetRequest,
    machine: &Machine,
    backend: &mut B,
    graphs: &[(&Graph, &ModelIndex)],
) -> Result<BudgetDecision> {
    // The backend's state for running the graphs (a GPU backend's compiled and launched
    // kernels) stays with the process: made once, before the budgets measure the process.
    for (g, _) in graphs {
        backend.prepare(g)?;
    }
    // The planner's own memory (its index of every tensor, the layouts it tries: tens of MiB
    // for a model of thousands of tensors) stays with the process while it plans: made, and
    // its two extreme layouts laid, before the process is measured.
    let mut planners = Vec::with_capacity(graphs.len());
    let mut least = Vec::with_capacity(graphs.len());
    for (g, model) in graphs {
        let p = Planner::new((*g).clone(), model, Rules::of(backend, g))?;
        least.push((p.min_device_bytes()?, p.resident_device_bytes()?));
        planners.push(p);
    }
    let ph = Phases {
        planners,
        machine,
        req,
    };
    let given = Ring {
        slots: req.slots.unwrap_or(AUTO_SLOTS),
        slot_size: req.slot_size.unwrap_or(AUTO_SLOT_SIZE),
    };
    let rss = crate::io::machine::rss_bytes().unwrap_or(0);
    let (budgets, mut note, plans) = budgets_for(&ph, &least, given, rss, backend)?;
    let (budgets, note, plans) = if req.slots.is_some() && req.slot_size.is_some() {
        (budgets, note, plans)
    } else {
        match grown_ring(&ph, given, budgets, &note) {
            None => (budgets, note, plans),
            Some((grown, needs, need, name, cap)) => {
                let bytes = grown.slots.saturating_mul(grown.slot_size);
                let holds = needs <= grown.slots;
                // The second planning may have left the process larger.
                let rss = crate::io::machine::rss_bytes()
                    .unwrap_or(0)
                    .max(note.rss_at_plan);
                match budgets_for(&ph, &least, grown, rss, backend) {
                    // A ring the budgets cannot hold leaves the run with the smaller one.
                    Err(e) => {
                        note.note.push_str(&format!(
                            "; ring {} x {}: the largest streamed group ({name}, {}) does not \
                             fit it, and a ring that would does not fit the budgets ({e})",
                            given.slots,
                            fmt_bytes(given.slot_size),
                            fmt_bytes(need)
                        ));
                        note.rss_at_plan = rss;
                        (budgets, note, plans)
                    }
                    Ok((b2, mut note2, plans2)) => {
                        note2.note.push_str(&format!(
                            "; ring auto {} x {} = {}: {} the largest streamed group ({name}, \
                             {}){}",
                            grown.slots,
                            fmt_bytes(grown.slot_size),
                            fmt_bytes(bytes),
                            if holds { "holds" } else { "capped below" },
                            fmt_bytes(need),
                            if holds {
                                String::new()
                            } else {
                                format!(
                                    " (at most {} and {AUTO_SLOTS_MAX} slots: an eighth of the \
                                     host budget left after the process, 1 GiB)",
                                    fmt_bytes(cap)
                                )
                            }
                        ));
                        (b2, note2, plans2)
                    }
                }
            }
        }
    };
    let phases = plans
        .into_iter()
        .zip(&least)
        .map(|(plan, &(min, resident))| PhaseBudget {
            plan: plan.map_err(|e| e.to_string()),
            min_device_bytes: min,
            resident_device_bytes: resident,
        })
        .collect();
    Ok(BudgetDecision {
        budgets,
        stream_all: req.stream_all,
        note,
        phases,
    })
}

/// Each of `graphs`' plan under budgets decided before (a pipeline whose phases changed after the
/// decision, a VAE that tiles), with its extremes: one planner per graph.
pub fn phase_budgets<B: Backend + ?Sized>(
    budgets: Budgets,
    stream_all: bool,
    machine: &Machine,
    backend: &mut B,
    graphs: &[(&Graph, &ModelIndex)],
) -> Result<Vec<PhaseBudget>> {
    graphs
        .iter()
        .map(|(g, model)| {
            let p = Planner::new((*g).clone(), model, Rules::of(backend, g))?;
            Ok(PhaseBudget {
                plan: p
                    .plan_within(budgets, stream_all, machine.available)
                    .map(|x| x.0)
                    .map_err(|e| e.to_string()),
                min_device_bytes: p.min_device_bytes()?,
                resident_device_bytes: p.resident_device_bytes()?,
            })
        })
        .collect()
}

/// The ring the largest streamed group asks for where the request leaves the ring `auto`:
/// the ring, the slots the group takes with its slot size, the group's bytes and name, and the
/// cap on the ring's bytes; `None` when the given ring holds it (or a grown one would not be
/// larger).
fn grown_ring(
    ph: &Phases<'_>,
    given: Ring,
    budgets: Budgets,
    note: &BudgetNote,
) -> Option<(Ring, u64, u64, String, u64)> {
    let with_slot = |size: u64| Budgets {
        slot_bytes: size,
        ..budgets
    };
    let (_, need, name) = ph
        .largest(with_slot(given.slot_size))
        .filter(|l| l.0 > given.slots)?;
    let room = note
        .host_budget
        .map_or(AUTO_RING_MAX, |h| h.saturating_sub(note.rss_at_plan) / 8);
    let cap = room.min(AUTO_RING_MAX);
    let (grown, needs) = match (ph.req.slots, ph.req.slot_size) {
        // A count given: slots of whole MiB large enough between them, doubled while the
        // group's chunks do not fit them.
        (Some(n), _) => {
            let mut size = need
                .div_ceil(n)
                .next_multiple_of(1 << 20)
                .max(AUTO_SLOT_SIZE);
            while size.saturating_mul(n) <= cap
                && ph.largest(with_slot(size)).is_some_and(|l| l.0 > n)
            {
                size = size.saturating_mul(2);
            }
            let size = size.min((cap / n).max(AUTO_SLOT_SIZE));
            let needs = ph.largest(with_slot(size)).map_or(0, |l| l.0);
            (
                Ring {
                    slots: n,
                    slot_size: size,
                },
                needs,
            )
        }
        // 32 MiB slots, at least 16 of them (fewer or smaller left the disk idle, measured on
        // a 35 GiB synthetic Llama of 100 MiB layers read from disk: 16 x 32 MiB 11.7 s a
        // token, 10 x 16 MiB 16.8-18.9 s, 32 x 16 MiB 15.6 s), more where the largest group
        // takes more.
        (None, given_size) => {
            let size = given_size.unwrap_or(AUTO_GROWN_SLOT_SIZE);
            let needs = ph.largest(with_slot(size)).map_or(0, |l| l.0);
            let slots = if needs == 0 {
                AUTO_SLOTS
            } else {
                needs.max(AUTO_GROWN_SLOTS)
            };
            let ring = Ring {
                slots: slots.min(cap / size).clamp(AUTO_SLOTS, AUTO_SLOTS_MAX),
                slot_size: size,
            };
            (ring, needs)
        }
    };
    let bytes = grown.slots.saturating_mul(grown.slot_size);
    (bytes > given.slots.saturating_mul(given.slot_size)).then_some((grown, needs, need, name, cap))
}

/// The budgets of the phases with this ring, a note saying where the device budget came
/// from (see [`decide`]) and each phase's plan under them; `least` is each phase's (every group streamed, every group resident)
/// device bytes, `rss` the process's memory now.
fn budgets_for<B: Backend + ?Sized>(
    ph: &Phases<'_>,
    least: &[(u64, u64)],
    r: Ring,
    rss: u64,
    backend: &mut B,
) -> Result<(Budgets, BudgetNote, Vec<Result<MemoryPlan>>)> {
    let req = ph.req;
    let ring = r.slots.saturating_mul(r.slot_size);
    let need = least.iter().map(|l| l.1).max().unwrap_or(0);
    // A phase runs with the smaller of its two: streamed groups take staging and per-group
    // buffers on the device that resident ones do not, so where activations dominate (a small
    // model, long prefill chunks) every weight resident is the least.
    let least_all = least.iter().map(|l| l.0.min(l.1)).max().unwrap_or(0);
    let (host, host_note) = match req.host {
        Budget::Bytes(b) => (Some(b), format!("host budget {} (given)", fmt_bytes(b))),
        // What is available now is in addition to what this process already holds.
        Budget::Auto => match &ph.machine.host {
            Some(h) => (
                Some(h.budget() + rss),
                format!(
                    "host budget auto {} (the process's {} + {}; margin {})",
                    fmt_bytes(h.budget() + rss),
                    fmt_bytes(rss),
                    h.source,
                    fmt_bytes(h.margin())
                ),
            ),
            None => (None, "host memory unknown on this system".to_string()),
        },
    };
    if let Some(h) = host {
        if rss.saturating_add(ring) > h {
            return Err(Error::Invalid(format!(
                "{host_note} cannot hold the process ({}) and the ring ({} x {} = {})",
                fmt_bytes(rss),
                r.slots,
                fmt_bytes(r.slot_size),
                fmt_bytes(ring)
            )));
        }
    }
    let shares_host = backend.host_memory().is_some();
    let info = backend.device_info();
    // The device's memory is RAM here too (a CPU renderer, an integrated GPU), though its
    // buffers are its own.
    let device_in_ram = shares_host || info.memory_is_host();
    // The largest host bytes of the phases' plans with this device budget, at least the ring.
    let host_peak = |device_bytes: u64| {
        ph.plans(ph.budgets(r, device_bytes))
            .into_iter()
            .flatten()
            .fold(ring, |m, p| m.max(p.peak_host_bytes))
    };
    let (device_bytes, note) = match req.device {
        DeviceBudget::Bytes(b) => (
            b,
            format!("device budget {} (given); {host_note}", fmt_bytes(b)),
        ),
        DeviceBudget::Least => (
            least_all,
            format!(
                "device budget {}: the least that runs every phase, every group streamed; \
                 {host_note}",
                fmt_bytes(least_all)
            ),
        ),
        DeviceBudget::Resident => (
            need,
            format!(
                "device budget {}: every weight resident; {host_note}",
                fmt_bytes(need)
            ),
        ),
        DeviceBudget::Auto => match host.filter(|_| shares_host) {
            Some(h) => {
                // The host budget less the process and the ring, less what the plans add
                // besides (loader and kernel buffers), found by planning.
                let mut room = h - rss - ring;
                for _ in 0..3 {
                    // The device memory allocated never exceeds its budget.
                    let fits = h
                        .saturating_sub(rss)
                        .saturating_sub(host_peak(room.min(need)));
                    if fits >= room {
                        break;
                    }
                    room = fits;
                }
                if room < least_all {
                    return Err(Error::Invalid(format!(
                        "the {host_note} leaves {} for device memory (host memory on this \
                         backend) after the process ({}) and the ring ({} x {}) and their \
                         buffers; the run needs at least {} (every group streamed, or every \
                         weight resident where that is less): give \
                         a larger --host-budget, or fewer or smaller ring slots",
                        fmt_bytes(room),
                        fmt_bytes(rss),
                        r.slots,
                        fmt_bytes(r.slot_size),
                        fmt_bytes(least_all)
                    )));
                }
                if need <= room {
                    (
                        need,
                        format!(
                            "device budget auto {}: every weight resident, within the {host_note}",
                            fmt_bytes(need)
                        ),
                    )
                } else {
                    (
                        room,
                        format!(
                            "device budget auto {}: the {host_note} less the process ({}) and the \
                             ring ({}), on this backend device memory is host memory; every \
                             weight resident would need {}",
                            fmt_bytes(room),
                            fmt_bytes(rss),
                            fmt_bytes(ring),
                            fmt_bytes(need)
                        ),
                    )
                }
            }
            None => match info.memory {
                // The driver's free memory less a margin of a tenth of the total (at least
                // 256 MiB): what the other users of the device and its driver keep.
                Some((free, total)) => {
                    let margin = (total / 10).max(256 << 20);
                    let cap = free.saturating_sub(margin);
                    let said = format!(
                        "the device's free {} of {} less a margin of {}",
                        fmt_bytes(free),
                        fmt_bytes(total),
                        fmt_bytes(margin)
                    );
                    if need <= cap {
                        (
                            need,
                            format!(
                                "device budget auto {}: every weight resident, within {said}; \
                                 {host_note}",
                                fmt_bytes(need)
                            ),
                        )
                    } else {
                        (
                            cap,
                            format!(
                                "device budget auto {}: {said}; every weight resident would \
                                 need {}; {host_note}",
                                fmt_bytes(cap),
                                fmt_bytes(need)
                            ),
                        )
                    }
                }
                None => limited_auto(&info, need, &host_note),
            },
        },
    };
    let (device_bytes, note) = match (req.device, host) {
        (DeviceBudget::Auto, Some(h)) if device_in_ram && !shares_host => {
            // The auto budget above is the device's; its memory is RAM, so the host budget
            // bounds it too.
            let room = h
                .saturating_sub(rss)
                .saturating_sub(host_peak(device_bytes));
            if device_bytes > room {
                (
                    room,
                    format!(
                        "{note}; capped at {}: the device's memory is RAM (a CPU renderer or an \
                         integrated GPU), within the host budget less the process and the plan's \
                         host buffers",
                        fmt_bytes(room)
                    ),
                )
            } else {
                (device_bytes, note)
            }
        }
        _ => (device_bytes, note),
    };
    let mut budgets = ph.budgets(r, device_bytes);
    let mut note = note;
    if req.stream_all {
        note.push_str("; --stream-all: every weight group streams whatever the budget holds");
    }
    let mut plans = ph.plans(budgets);
    if let (Some(h), false) = (host, shares_host) {
        // The host tier: what the host budget holds besides the process and each phase's
        // ring, loader and kernel buffers keeps streamed groups in RAM after their first read.
        let mut room = u64::MAX;
        let mut streams = false;
        for plan in plans.iter().flatten() {
            streams |= plan.counts().1 > 0;
            room = room.min(
                h.saturating_sub(rss)
                    .saturating_sub(plan.host_bytes_with_device()),
            );
        }
        if streams && room != u64::MAX && room > 0 {
            budgets.host_tier_bytes = room;
            note.push_str(&format!(
                "; host tier up to {} for groups the device budget does not hold",
                fmt_bytes(room)
            ));
            plans = ph.plans(budgets);
        }
    }
    if let Some(h) = host {
        // A budget the planner refuses is reported by the run itself, with its minimum.
        for plan in plans.iter().flatten() {
            let need = rss.saturating_add(plan.host_bytes_with_device());
            if need > h {
                return Err(Error::Invalid(format!(
                    "the plan needs {} of host memory (the process {} + ring, loader and kernel \
                     buffers {}{}), over the {host_note}: give a smaller --device-budget, \
                     --slots or --slot-size, or a larger --host-budget",
                    fmt_bytes(need),
                    fmt_bytes(rss),
                    fmt_bytes(plan.peak_host_bytes),
                    if plan.device_in_host_memory {
                        format!(
                            " + device memory, which is host memory here, {}",
                            fmt_bytes(plan.peak_device_bytes)
                        )
                    } else {
                        String::new()
                    }
                )));
            }
        }
    }
    Ok((
        budgets,
        BudgetNote {
            note,
            rss_at_plan: rss,
            host_budget: host,
            device_budget: device_bytes,
        },
        plans,
    ))
}

/// `auto` on a device that tells limits, not free memory (a wgpu adapter): every weight
/// resident within a stated fraction of its allocation limit, else that fraction.
fn limited_auto(info: &DeviceInfo, need: u64, host_note: &str) -> (u64, String) {
    let (num, den) = crate::backend::AUTO_LIMIT_FRACTION;
    match info.allocation_limit {
        Some((limit, what)) => {
            let cap = limit / den * num;
            let said = format!(
                "{num}/{den} of the adapter's {what} of {} (it does not tell its free memory: \
                 give --device-budget to set it)",
                fmt_bytes(limit)
            );
            if need <= cap {
                (
                    need,
                    format!(
                        "device budget auto {}: every weight resident, within {said}; {host_note}",
                        fmt_bytes(need)
                    ),
                )
            } else {
                (
                    cap,
                    format!(
                        "device budget auto {}: {said}; every weight resident would need {}; \
                         {host_note}",
                        fmt_bytes(cap),
                        fmt_bytes(need)
                    ),
                )
            }
        }
        None => (
            need,
            format!(
                "device budget auto {}: every weight resident (this device does not tell its \
                 free memory: give --device-budget to cap it); {host_note}",
                fmt_bytes(need)
            ),
        ),
    }
}
