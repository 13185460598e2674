//! The memory plan: before any byte is read, decide which weight groups stay resident on the
//! device and which stream every step, and predict every byte of host and device memory the run
//! will use. An impossible budget is refused with the smallest budgets that would work.

use crate::error::{Error, Result};

/// Smallest ring slot nibble accepts: one page, the `O_DIRECT` alignment.
pub const MIN_SLOT_BYTES: u64 = 4096;

/// One weight group (usually one layer's weights) in schedule (first-use) order.
#[derive(Debug, Clone, PartialEq)]
pub struct WeightGroup {
    /// Name for messages, e.g. `model.layers.3`.
    pub name: String,
    /// Bytes of all its tensors as stored (packed 4-bit data included): what a step reads.
    pub bytes: u64,
    /// Bytes it takes on the device (4-bit codes, f32 absmax and code table; dense tensors as
    /// f32): what keeping it resident costs.
    pub device_bytes: u64,
    /// Bytes of its stream-pool slot when it streams (its 4-bit weights, aligned).
    pub slot_bytes: u64,
    /// Bytes its dense tensors take in the arena (f32, or bf16 where the backend reads bf16)
    /// while it is live, when it streams.
    pub dense_bytes: u64,
    /// Dense tensors it shares with other groups (tied embeddings): (other group, f32 bytes).
    /// While the other group is resident this group reads that copy and needs no room of its own.
    pub shared: Vec<(usize, u64)>,
}

/// What the user allows.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Budgets {
    /// Device memory for weights (resident groups plus the streaming pool).
    pub device_bytes: u64,
    /// Staging ring slots.
    pub ring_slots: u64,
    /// Bytes per ring slot (a larger tensor streams through in chunks).
    pub slot_bytes: u64,
    /// Host RAM for keeping streamed groups after their first read (0: none).
    pub host_cache_bytes: u64,
    /// Device bytes needed besides weights (activation arena, KV cache), from the graph.
    pub device_other_bytes: u64,
    /// Host bytes needed besides the ring and cache (activations on the host, fixed overhead).
    pub host_other_bytes: u64,
}

/// Where a group lives during the run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Placement {
    /// Uploaded once, kept on the device.
    Resident,
    /// Read through the ring every step.
    Streamed,
    /// Read once, then served from the host cache every step.
    HostCached,
}

/// The plan.
#[derive(Debug, Clone, PartialEq)]
pub struct MemoryPlan {
    /// The groups, in schedule order.
    pub groups: Vec<WeightGroup>,
    /// Placement of each group.
    pub placement: Vec<Placement>,
    /// The budgets it was made for.
    pub budgets: Budgets,
    /// Bytes of resident groups.
    pub resident_bytes: u64,
    /// Device room for streamed groups: two alternating pool slots and the arena room of two
    /// consecutive streamed groups' dense tensors.
    pub pool_bytes: u64,
    /// Host cache bytes used.
    pub host_cache_used: u64,
    /// Ring bytes (slots x slot size).
    pub ring_bytes: u64,
    /// Reads kept in flight ahead of the consumer (one per ring slot).
    pub prefetch_depth: u64,
    /// Bytes read from the source per step (after the first).
    pub streamed_bytes_per_step: u64,
    /// Bytes uploaded from host to device per step (streamed plus host-cached).
    pub uploaded_bytes_per_step: u64,
    /// Of those, the most that kernels read in place from the ring slots instead (packed
    /// weights no larger than a slot, on a backend that reads host memory: the optimized CPU
    /// backend); a slot is lent only while another stays free, so a run may read fewer.
    pub in_place_bytes_per_step: u64,
    /// Predicted peak device bytes.
    pub peak_device_bytes: u64,
    /// Predicted peak host bytes.
    pub peak_host_bytes: u64,
    /// The allocation made for the plan, once the executor has laid everything out.
    pub allocation: Option<Allocation>,
}

/// What the executor actually allocated on the device for a plan (allocated once).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Allocation {
    /// Weight pool: resident 4-bit weights plus the two stream slots.
    pub pool_bytes: u64,
    /// Activation arena, resident dense weights and persistent state included.
    pub arena_bytes: u64,
    /// Of the arena: persistent state (KV cache).
    pub state_bytes: u64,
    /// Of the arena: resident dense weights (f32, or bf16 where the backend reads bf16).
    pub resident_dense_bytes: u64,
}

/// Human-readable sizes (binary units).
pub fn fmt_bytes(b: u64) -> String {
    const U: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = b as f64;
    let mut i = 0;
    while v >= 1024.0 && i < U.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{b} B")
    } else {
        format!("{v:.2} {}", U[i])
    }
}

/// Parses sizes like `512MiB`, `1.5GiB`, `64k`, `4096` (binary multiples).
pub fn parse_size(s: &str) -> Result<u64> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| Error::Invalid(format!("size '{s}': expected e.g. 512MiB, 1.5GiB, 4096")))?;
    let mult = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1u64,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(Error::Invalid(format!("size '{s}': unknown unit '{u}'"))),
    };
    let bytes = v * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(Error::Invalid(format!("size '{s}' is out of range")));
    }
    Ok(bytes.round() as u64)
}

/// Per group, (device bytes, dense bytes) given which groups stream: a tensor shared with a
/// resident group costs nothing in this one (when both are resident, the earlier one holds it).
fn effective(groups: &[WeightGroup], streamed: &[bool]) -> Vec<(u64, u64)> {
    groups
        .iter()
        .enumerate()
        .map(|(g, w)| {
            let saved: u64 = w
                .shared
                .iter()
                .filter(|(o, _)| !streamed[*o] && (*o < g || streamed[g]))
                .map(|(_, b)| *b)
                .sum();
            (
                w.device_bytes.saturating_sub(saved),
                w.dense_bytes.saturating_sub(saved),
            )
        })
        .collect()
}

/// Device bytes the streamed groups need (in schedule order, `streamed[i]` for group i): two
/// alternating pool slots, each as large as the largest 4-bit part that lands in it, plus arena
/// room for the dense tensors of two consecutive streamed groups (one in use, the next loading).
pub fn stream_pool_bytes(groups: &[WeightGroup], streamed: &[bool]) -> u64 {
    let eff = effective(groups, streamed);
    let seq: Vec<(u64, u64)> = groups
        .iter()
        .zip(&eff)
        .zip(streamed)
        .filter(|(_, s)| **s)
        .map(|((g, e), _)| (g.slot_bytes, e.1))
        .collect();
    let mut slots = [0u64; 2];
    for (i, g) in seq.iter().enumerate() {
        slots[i % 2] = slots[i % 2].max(g.0);
    }
    let dense = match seq.as_slice() {
        [one] => one.1,
        _ => seq.windows(2).map(|w| w[0].1 + w[1].1).max().unwrap_or(0),
    };
    slots[0] + slots[1] + dense
}

fn pool_for(groups: &[WeightGroup], streamed: &[bool]) -> u64 {
    stream_pool_bytes(groups, streamed)
}

impl MemoryPlan {
    /// Makes the plan or refuses, naming the numbers that would fit.
    pub fn new(groups: Vec<WeightGroup>, budgets: Budgets) -> Result<Self> {
        Self::make(groups, budgets, true)
    }

    /// A plan that streams every group each step, whatever the budget allows.
    pub fn streaming_all(groups: Vec<WeightGroup>, budgets: Budgets) -> Result<Self> {
        Self::make(groups, budgets, false)
    }

    fn make(groups: Vec<WeightGroup>, budgets: Budgets, allow_resident: bool) -> Result<Self> {
        if budgets.ring_slots == 0 || budgets.slot_bytes == 0 {
            return Err(Error::Invalid(format!(
                "the staging ring needs at least 1 slot of at least {} ({} slots x {} given)",
                fmt_bytes(MIN_SLOT_BYTES),
                budgets.ring_slots,
                fmt_bytes(budgets.slot_bytes)
            )));
        }
        if budgets.slot_bytes < MIN_SLOT_BYTES {
            return Err(Error::Invalid(format!(
                "ring slot of {} is smaller than one chunk ({}): use --slot-size {} or more",
                fmt_bytes(budgets.slot_bytes),
                fmt_bytes(MIN_SLOT_BYTES),
                MIN_SLOT_BYTES
            )));
        }
        let n = groups.len();
        let device_for_weights = budgets.device_bytes.checked_sub(budgets.device_other_bytes);
        let all_streamed = vec![true; n];
        let min_pool = pool_for(&groups, &all_streamed);
        let min_device = budgets.device_other_bytes + min_pool;
        let Some(avail) = device_for_weights.filter(|&a| a >= min_pool) else {
            let largest = groups.iter().max_by_key(|g| g.slot_bytes + g.dense_bytes);
            return Err(Error::Invalid(format!(
                "device budget {} cannot hold the run: activations and caches need {}, and the \
                 streaming needs room for two weight groups at a time ({}{}): use \
                 --device-budget {} or more",
                fmt_bytes(budgets.device_bytes),
                fmt_bytes(budgets.device_other_bytes),
                fmt_bytes(min_pool),
                largest
                    .map(|g| format!(
                        ", largest '{}' {}",
                        g.name,
                        fmt_bytes(g.slot_bytes + g.dense_bytes)
                    ))
                    .unwrap_or_default(),
                fmt_bytes(min_device)
            )));
        };
        // Keep groups resident in schedule order while the rest still fits the pool.
        let mut streamed = all_streamed;
        let mut resident = 0u64;
        for i in (0..n).filter(|_| allow_resident) {
            streamed[i] = false;
            let pool = pool_for(&groups, &streamed);
            let cost = effective(&groups, &streamed)[i].0;
            if resident + cost + pool <= avail {
                resident += cost;
            } else {
                streamed[i] = true;
            }
        }
        let pool_bytes = pool_for(&groups, &streamed);
        let mut placement = Vec::with_capacity(n);
        let mut cache_used = 0u64;
        let (mut streamed_bytes, mut uploaded) = (0u64, 0u64);
        for (g, s) in groups.iter().zip(&streamed) {
            if !*s {
                placement.push(Placement::Resident);
            } else if cache_used + g.bytes <= budgets.host_cache_bytes {
                cache_used += g.bytes;
                uploaded += g.bytes;
                placement.push(Placement::HostCached);
            } else {
                streamed_bytes += g.bytes;
                uploaded += g.bytes;
                placement.push(Placement::Streamed);
            }
        }
        let ring_bytes = budgets.ring_slots.saturating_mul(budgets.slot_bytes);
        Ok(MemoryPlan {
            groups,
            placement,
            budgets,
            resident_bytes: resident,
            pool_bytes,
            host_cache_used: cache_used,
            ring_bytes,
            prefetch_depth: budgets.ring_slots,
            streamed_bytes_per_step: streamed_bytes,
            uploaded_bytes_per_step: uploaded,
            in_place_bytes_per_step: 0,
            peak_device_bytes: resident + pool_bytes + budgets.device_other_bytes,
            peak_host_bytes: ring_bytes + cache_used + budgets.host_other_bytes,
            allocation: None,
        })
    }

    /// Records what was allocated for this plan and makes the device figures exact; refuses an
    /// allocation over the device budget (with the budget that would fit).
    pub fn set_allocation(&mut self, a: Allocation) -> Result<()> {
        let peak = a.pool_bytes + a.arena_bytes;
        if peak > self.budgets.device_bytes {
            return Err(Error::Invalid(format!(
                "device budget {} cannot hold the run as laid out: weight pool {} + arena {} = {}: \
                 use --device-budget {} or more",
                fmt_bytes(self.budgets.device_bytes),
                fmt_bytes(a.pool_bytes),
                fmt_bytes(a.arena_bytes),
                fmt_bytes(peak),
                fmt_bytes(peak)
            )));
        }
        self.peak_device_bytes = peak;
        self.allocation = Some(a);
        Ok(())
    }

    /// Adds fixed host memory the executor keeps besides the ring (the loading group's small
    /// tensors, the absmax buffer).
    pub fn add_host_other(&mut self, bytes: u64) {
        self.budgets.host_other_bytes += bytes;
        self.peak_host_bytes += bytes;
    }

    /// `bytes` of group `g` need no reading because a resident group holds the same tensors
    /// (tied embeddings): the group reads and uploads that much less per step.
    pub fn served_elsewhere(&mut self, g: usize, bytes: u64) {
        let b = bytes.min(self.groups[g].bytes);
        self.groups[g].bytes -= b;
        if self.placement[g] != Placement::Resident {
            self.uploaded_bytes_per_step -= b.min(self.uploaded_bytes_per_step);
            if self.placement[g] == Placement::Streamed {
                self.streamed_bytes_per_step -= b.min(self.streamed_bytes_per_step);
            }
        }
    }

    /// Number of groups with each placement: (resident, streamed, host-cached).
    pub fn counts(&self) -> (usize, usize, usize) {
        let c = |p| self.placement.iter().filter(|&&x| x == p).count();
        (
            c(Placement::Resident),
            c(Placement::Streamed),
            c(Placement::HostCached),
        )
    }

    /// The text printed before a run.
    pub fn explain(&self) -> String {
        let (r, s, h) = self.counts();
        let total: u64 = self.groups.iter().map(|g| g.bytes).sum();
        let b = &self.budgets;
        let mut t = String::new();
        t.push_str(&format!(
            "memory plan: {} weight groups, {} of weights\n",
            self.groups.len(),
            fmt_bytes(total)
        ));
        match &self.allocation {
            Some(a) => t.push_str(&format!(
                "  device  budget {:>10}  allocated {:>10} = weight pool {} ({r} groups resident, {s} streamed through 2 slots) + arena {} (activations {}, resident dense weights {}, KV cache {})\n",
                fmt_bytes(b.device_bytes),
                fmt_bytes(self.peak_device_bytes),
                fmt_bytes(a.pool_bytes),
                fmt_bytes(a.arena_bytes),
                fmt_bytes(a.arena_bytes - a.state_bytes - a.resident_dense_bytes),
                fmt_bytes(a.resident_dense_bytes),
                fmt_bytes(a.state_bytes)
            )),
            None => t.push_str(&format!(
                "  device  budget {:>10}  peak {:>10} = resident {} ({r} groups) + stream pool {} + activations/caches {}\n",
                fmt_bytes(b.device_bytes),
                fmt_bytes(self.peak_device_bytes),
                fmt_bytes(self.resident_bytes),
                fmt_bytes(self.pool_bytes),
                fmt_bytes(b.device_other_bytes)
            )),
        }
        t.push_str(&format!(
            "  host    ring {} x {} = {}, cache {} of {} ({h} groups), other {}: peak {}\n",
            b.ring_slots,
            fmt_bytes(b.slot_bytes),
            fmt_bytes(self.ring_bytes),
            fmt_bytes(self.host_cache_used),
            fmt_bytes(b.host_cache_bytes),
            fmt_bytes(b.host_other_bytes),
            fmt_bytes(self.peak_host_bytes)
        ));
        let copied = if self.in_place_bytes_per_step > 0 {
            format!(
                "up to {} of it read in place from the ring and the rest copied into the weight pool",
                fmt_bytes(self.in_place_bytes_per_step)
            )
        } else {
            format!(
                "{} uploaded per step",
                fmt_bytes(self.uploaded_bytes_per_step)
            )
        };
        t.push_str(&format!(
            "  stream  {s} groups, {} read per step, {copied}, prefetch depth {}\n",
            fmt_bytes(self.streamed_bytes_per_step),
            self.prefetch_depth
        ));
        t
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn groups(sizes: &[u64]) -> Vec<WeightGroup> {
        sizes
            .iter()
            .enumerate()
            .map(|(i, &b)| WeightGroup {
                name: format!("g{i}"),
                bytes: b,
                device_bytes: b,
                slot_bytes: b,
                dense_bytes: 0,
                shared: Vec::new(),
            })
            .collect()
    }

    fn budgets(device: u64) -> Budgets {
        Budgets {
            device_bytes: device,
            ring_slots: 4,
            slot_bytes: 1 << 20,
            host_cache_bytes: 0,
            device_other_bytes: 0,
            host_other_bytes: 0,
        }
    }

    #[test]
    fn everything_resident_when_it_fits() {
        let p = MemoryPlan::new(groups(&[100, 200, 300]), budgets(10_000)).expect("plan");
        assert_eq!(p.counts(), (3, 0, 0));
        assert_eq!(p.streamed_bytes_per_step, 0);
        assert_eq!(p.peak_device_bytes, 600);
    }

    #[test]
    fn streams_what_does_not_fit_and_stays_within_budget() {
        let g = groups(&[100; 10]);
        let p = MemoryPlan::new(g, budgets(500)).expect("plan");
        assert!(p.peak_device_bytes <= 500, "{}", p.explain());
        let (r, s, _) = p.counts();
        assert_eq!(r + s, 10);
        assert_eq!(p.pool_bytes, 200);
        assert_eq!(r, 3);
        assert_eq!(p.streamed_bytes_per_step, 700);
        assert!(p.explain().contains("prefetch depth 4"));
    }

    #[test]
    fn impossible_budget_names_the_smallest_that_works() {
        let e = MemoryPlan::new(groups(&[100, 300, 250]), budgets(400)).expect_err("too small");
        let msg = e.to_string();
        assert!(msg.contains("--device-budget 550 B"), "{msg}");
        assert!(msg.contains("'g1'"), "{msg}");
        let ok = MemoryPlan::new(groups(&[100, 300, 250]), budgets(550)).expect("550 fits");
        assert_eq!(ok.counts().0, 0);
    }

    #[test]
    fn host_cache_takes_streamed_groups() {
        let mut b = budgets(250);
        b.host_cache_bytes = 250;
        let p = MemoryPlan::new(groups(&[100, 100, 100, 100]), b).expect("plan");
        assert_eq!(p.counts(), (0, 2, 2));
        assert_eq!(p.streamed_bytes_per_step, 200);
        assert_eq!(p.peak_host_bytes, 4 * (1 << 20) + 200);
    }

    #[test]
    fn ring_errors() {
        let mut b = budgets(1000);
        b.slot_bytes = 0;
        assert!(MemoryPlan::new(groups(&[1]), b)
            .expect_err("0")
            .to_string()
            .contains("at least 1 slot"));
        b.slot_bytes = 1000;
        assert!(MemoryPlan::new(groups(&[1]), b)
            .expect_err("small")
            .to_string()
            .contains("smaller than one chunk"));
        b.slot_bytes = 4096;
        b.ring_slots = 0;
        assert!(MemoryPlan::new(groups(&[1]), b).is_err());
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("512MiB").expect("s"), 512 << 20);
        assert_eq!(parse_size("1.5GiB").expect("s"), 3 << 29);
        assert_eq!(parse_size("64k").expect("s"), 65536);
        assert_eq!(parse_size("4096").expect("s"), 4096);
        assert!(parse_size("12 parsecs").is_err());
        assert!(parse_size("").is_err());
    }
}
