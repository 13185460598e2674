//! What the machine has: memory available, this process's RSS (Linux `/proc`; `None`
//! elsewhere), and the check every allocation sized by an input goes through first.

use crate::error::{Error, Result};

/// Refuses to allocate `bytes` for `what` when they are more than the memory available (where
/// the machine says how much that is): a size read from a file or the command line must not
/// abort the process on a failed allocation.
pub fn check_alloc(bytes: u64, what: &str) -> Result<()> {
    check_alloc_within(available_memory_bytes(), bytes, what)
}

/// [`check_alloc`] against memory available read before (`None`: unknown).
pub fn check_alloc_within(available: Option<u64>, bytes: u64, what: &str) -> Result<()> {
    if let Some(avail) = available {
        if bytes > avail {
            return Err(Error::Invalid(format!(
                "{what} needs {bytes} bytes, more than the {avail} bytes of memory available"
            )));
        }
    }
    if usize::try_from(bytes).is_err() {
        return Err(Error::Invalid(format!(
            "{what} needs {bytes} bytes, more than this machine can address"
        )));
    }
    Ok(())
}

/// Resident set size now, in bytes.
pub fn rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/statm").ok()?;
    let pages: u64 = s.split_whitespace().nth(1)?.parse().ok()?;
    Some(pages * page_size())
}

/// Peak resident set size of the process so far (`VmHWM`), in bytes.
pub fn peak_rss_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

/// Resets the peak RSS (`VmHWM`) to the current RSS, so that a phase's own peak can be read
/// afterwards; false where the kernel does not allow it.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// The memory this process may still use: `MemAvailable`, capped by its cgroup's limit less its
/// usage (a container's limit) and by its address-space limit less what it maps, in bytes.
pub fn available_memory_bytes() -> Option<u64> {
    host_memory().map(|h| h.available)
}

/// `MemAvailable` from the text of `/proc/meminfo`, in bytes.
pub fn parse_meminfo(text: &str) -> Option<u64> {
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

/// A cgroup memory limit and usage as the kernel writes them (v2 `memory.max` /
/// `memory.current`, v1 `memory.limit_in_bytes` / `memory.usage_in_bytes`): the bytes left
/// under the limit, `None` where there is no limit (`max`, or v1's "unlimited" near 2^63).
/// The usage counts page cache; [`cgroup_room_of`] gives back its reclaimable part.
pub fn cgroup_room(limit: &str, usage: &str) -> Option<u64> {
    let limit = limit.trim();
    if limit == "max" {
        return None;
    }
    let limit: u64 = limit.parse().ok()?;
    // v1 writes "no limit" as the largest page-aligned i64.
    if limit >= 1 << 62 {
        return None;
    }
    let usage: u64 = usage.trim().parse().unwrap_or(0);
    Some(limit.saturating_sub(usage))
}

/// The memory cgroup paths of `/proc/self/cgroup`'s text: the unified (v2, `0::PATH`) one and
/// the v1 `memory` controller's.
pub fn parse_proc_cgroup(text: &str) -> (Option<String>, Option<String>) {
    let (mut v2, mut v1) = (None, None);
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (Some(id), Some(ctrl), Some(path)) = (parts.next(), parts.next(), parts.next()) else {
            continue;
        };
        if id == "0" && ctrl.is_empty() {
            v2 = Some(path.to_string());
        } else if ctrl.split(',').any(|c| c == "memory") {
            v1 = Some(path.to_string());
        }
    }
    (v2, v1)
}

/// What the machine lets this process use, and where the number came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostMemory {
    /// `MemAvailable`.
    pub mem_available: u64,
    /// The tightest cgroup room (limit less usage) of this process's cgroup and its parents.
    pub cgroup_room: Option<u64>,
    /// The smaller of the two.
    pub available: u64,
    /// Where the figures came from, for the plan's printout.
    pub source: String,
}

impl HostMemory {
    /// The safety margin kept free: a tenth of what is available, at least 256 MiB.
    pub fn margin(&self) -> u64 {
        (self.available / 10).max(256 << 20)
    }

    /// What `--host-budget auto` takes: the available memory less the margin.
    pub fn budget(&self) -> u64 {
        self.available.saturating_sub(self.margin())
    }
}

/// The tightest room under the cgroup limits of `path` and its parents, reading files through
/// `read` (`rel` is the file's path below the hierarchy's mount point): v2 when `v2` is true
/// (`memory.max` / `memory.current`), else v1 (`memory.limit_in_bytes` /
/// `memory.usage_in_bytes`). Each level's usage counts its children's, and its page cache: the
/// inactive file pages (`memory.stat`'s `inactive_file`, v1 `total_inactive_file`), which the
/// kernel reclaims before it would kill, count as room, as the kubelet counts them.
pub fn cgroup_room_of(
    path: &str,
    v2: bool,
    read: &dyn Fn(&str) -> Option<String>,
) -> Option<(u64, String)> {
    let (limit, usage) = if v2 {
        ("memory.max", "memory.current")
    } else {
        ("memory.limit_in_bytes", "memory.usage_in_bytes")
    };
    let mut best: Option<(u64, String)> = None;
    let mut at = path.trim_end_matches('/').to_string();
    loop {
        let dir = if at.is_empty() {
            String::new()
        } else {
            format!("{}/", at.trim_start_matches('/'))
        };
        if let (Some(l), Some(u)) = (
            read(&format!("{dir}{limit}")),
            read(&format!("{dir}{usage}")),
        ) {
            let key = if v2 {
                "inactive_file"
            } else {
                "total_inactive_file"
            };
            let inactive: u64 = read(&format!("{dir}memory.stat"))
                .and_then(|st| {
                    st.lines().find_map(|line| {
                        let (k, v) = line.split_once(' ')?;
                        (k == key).then(|| v.trim().parse().ok()).flatten()
                    })
                })
                .unwrap_or(0);
            if let Some(room) = cgroup_room(&l, &u).map(|r| r.saturating_add(inactive)) {
                if best.as_ref().is_none_or(|b| room < b.0) {
                    best = Some((
                        room,
                        format!(
                            "cgroup {} {}/{limit} {} - {usage} {}",
                            if v2 { "v2" } else { "v1" },
                            if at.is_empty() { "/" } else { &at },
                            l.trim(),
                            u.trim()
                        ),
                    ));
                }
            }
        }
        match at.rfind('/') {
            Some(i) if !at.is_empty() => at.truncate(i),
            _ => break,
        }
    }
    best
}

/// This machine's host memory for this process (Linux: `/proc/meminfo`, `/proc/self/cgroup`,
/// `/sys/fs/cgroup`); `None` where `/proc/meminfo` cannot be read.
pub fn host_memory() -> Option<HostMemory> {
    let mem_available = parse_meminfo(&std::fs::read_to_string("/proc/meminfo").ok()?)?;
    let (v2, v1) =
        parse_proc_cgroup(&std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default());
    let under =
        |root: &'static str| move |rel: &str| std::fs::read_to_string(format!("{root}/{rel}")).ok();
    let room = v2
        .as_deref()
        .and_then(|p| cgroup_room_of(p, true, &under("/sys/fs/cgroup")))
        .or_else(|| {
            v1.as_deref()
                .and_then(|p| cgroup_room_of(p, false, &under("/sys/fs/cgroup/memory")))
        });
    let mut h = HostMemory::from_parts(mem_available, room);
    if let Some((r, what)) = address_space_room() {
        h.available = h.available.min(r);
        h.source.push_str(&format!(
            ", {what} = {} left",
            crate::format::size::fmt_bytes(r)
        ));
    }
    Some(h)
}

/// Room under this process's address-space limit (`ulimit -v`, `RLIMIT_AS`): the limit less the
/// address space mapped now (`VmSize`), with where it came from; `None` without a limit. A
/// budget above it would pass every check and then abort on the first allocation it refuses.
pub fn address_space_room() -> Option<(u64, String)> {
    #[cfg(all(target_os = "linux", feature = "native"))]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes the struct it is given.
        if unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) } != 0
            || lim.rlim_cur == libc::RLIM_INFINITY
        {
            return None;
        }
        #[allow(clippy::unnecessary_cast)] // rlim_t is not u64 everywhere
        let limit = lim.rlim_cur as u64;
        let pages: u64 = std::fs::read_to_string("/proc/self/statm")
            .ok()?
            .split_whitespace()
            .next()?
            .parse()
            .ok()?;
        let mapped = pages.saturating_mul(page_size());
        let f = crate::format::size::fmt_bytes;
        Some((
            limit.saturating_sub(mapped),
            format!("RLIMIT_AS {} - VmSize {}", f(limit), f(mapped)),
        ))
    }
    #[cfg(not(all(target_os = "linux", feature = "native")))]
    {
        None
    }
}

impl HostMemory {
    /// From `MemAvailable` and the cgroup room with its description.
    pub fn from_parts(mem_available: u64, room: Option<(u64, String)>) -> Self {
        let mut source = format!(
            "MemAvailable {}",
            crate::format::size::fmt_bytes(mem_available)
        );
        let (cgroup_room, available) = match room {
            Some((r, what)) => {
                source.push_str(&format!(
                    ", {what} = {} left",
                    crate::format::size::fmt_bytes(r)
                ));
                (Some(r), r.min(mem_available))
            }
            None => {
                source.push_str(", no cgroup memory limit");
                (None, mem_available)
            }
        };
        HostMemory {
            mem_available,
            cgroup_room,
            available,
            source,
        }
    }
}

fn page_size() -> u64 {
    #[cfg(all(unix, feature = "native"))]
    {
        // SAFETY: sysconf has no preconditions.
        let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        if p > 0 {
            return p as u64;
        }
    }
    4096
}

/// Bytes free to an unprivileged writer on the file system that holds `path` (or its nearest
/// existing ancestor, for a folder not made yet); `None` where the system does not say.
pub fn free_disk_bytes(path: &std::path::Path) -> Option<u64> {
    #[cfg(all(unix, feature = "native"))]
    {
        let mut p = if path.is_absolute() {
            path.to_path_buf()
        } else {
            std::env::current_dir().ok()?.join(path)
        };
        while !p.exists() {
            if !p.pop() {
                return None;
            }
        }
        use std::os::unix::ffi::OsStrExt;
        let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
        // SAFETY: statvfs fills the struct it is given from a NUL-terminated path.
        let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
        if unsafe { libc::statvfs(c.as_ptr(), &mut s) } != 0 {
            return None;
        }
        #[allow(clippy::unnecessary_cast)] // the field types differ between unixes
        Some((s.f_bavail as u64).saturating_mul(s.f_frsize as u64))
    }
    #[cfg(not(all(unix, feature = "native")))]
    {
        let _ = path;
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn meminfo_gives_mem_available() {
        let t = "MemTotal:       24576000 kB\nMemFree:  100 kB\nMemAvailable:   20000000 kB\n";
        assert_eq!(parse_meminfo(t), Some(20_000_000 * 1024));
        assert_eq!(parse_meminfo("MemTotal: 5 kB\n"), None);
    }

    #[test]
    fn cgroup_limits_v2_v1_and_none() {
        assert_eq!(cgroup_room("max\n", "123\n"), None);
        assert_eq!(cgroup_room("8589934592\n", "1073741824\n"), Some(7 << 30));
        assert_eq!(
            cgroup_room("1000", "2000"),
            Some(0),
            "over the limit: no room"
        );
        // v1's "unlimited".
        assert_eq!(cgroup_room("9223372036854771712", "11597045760"), None);
        assert_eq!(cgroup_room("garbage", "1"), None);
    }

    #[test]
    fn proc_self_cgroup_names_the_v2_and_v1_paths() {
        let v2 = "0::/user.slice/user-1000.slice/session-2.scope\n";
        assert_eq!(
            parse_proc_cgroup(v2),
            (
                Some("/user.slice/user-1000.slice/session-2.scope".into()),
                None
            )
        );
        let v1 = "9:name=systemd:/\n4:memory:/process_api/ad8c\n1:cpu,cpuacct:/\n0::/\n";
        assert_eq!(
            parse_proc_cgroup(v1),
            (Some("/".into()), Some("/process_api/ad8c".into()))
        );
    }

    fn files(pairs: &[(&str, &str)]) -> impl Fn(&str) -> Option<String> {
        let m: HashMap<String, String> = pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        move |rel: &str| m.get(rel).cloned()
    }

    #[test]
    fn the_tightest_level_of_the_cgroup_tree_wins() {
        // v2: the container's own level is limited, its parent is not.
        let read = files(&[
            ("memory.max", "max"),
            ("memory.current", "5000000000"),
            ("kubepods/pod1/memory.max", "4294967296"),
            ("kubepods/pod1/memory.current", "1073741824"),
            ("kubepods/memory.max", "8589934592"),
            ("kubepods/memory.current", "2147483648"),
        ]);
        let (room, what) = cgroup_room_of("/kubepods/pod1", true, &read).expect("limited");
        assert_eq!(room, 3 << 30);
        // Its page cache's inactive part counts as room.
        let read2 = files(&[
            ("pod/memory.max", "4294967296"),
            ("pod/memory.current", "4000000000"),
            (
                "pod/memory.stat",
                "anon 1000000000\nfile 2900000000\ninactive_file 2000000000\n",
            ),
        ]);
        let (room2, _) = cgroup_room_of("/pod", true, &read2).expect("limited");
        assert_eq!(room2, 4294967296 - 4000000000 + 2000000000);
        let read1 = files(&[
            ("memory.limit_in_bytes", "1073741824"),
            ("memory.usage_in_bytes", "1073741824"),
            ("memory.stat", "cache 5\ntotal_inactive_file 536870912\n"),
        ]);
        assert_eq!(
            cgroup_room_of("/", false, &read1).map(|r| r.0),
            Some(512 << 20)
        );
        assert!(what.contains("kubepods/pod1/memory.max"), "{what}");
        // v1 with no limit anywhere.
        let read = files(&[
            ("memory.limit_in_bytes", "9223372036854771712"),
            ("memory.usage_in_bytes", "1"),
            ("a/memory.limit_in_bytes", "9223372036854771712"),
            ("a/memory.usage_in_bytes", "1"),
        ]);
        assert_eq!(cgroup_room_of("/a", false, &read), None);
        // MemAvailable caps a cgroup room larger than it, and the margin is stated.
        let h = HostMemory::from_parts(2 << 30, Some((3 << 30, "cgroup v2 ...".into())));
        assert_eq!(h.available, 2 << 30);
        assert_eq!(h.margin(), 256 << 20);
        assert_eq!(h.budget(), (2 << 30) - (256 << 20));
        let h = HostMemory::from_parts(16 << 30, None);
        assert_eq!(h.budget(), (16u64 << 30) - (16u64 << 30) / 10);
        assert!(h.source.contains("no cgroup memory limit"));
    }
}
