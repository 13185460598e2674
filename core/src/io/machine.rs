//! What the machine has: memory available, this process's RSS (Linux `/proc`; `None`
//! elsewhere), and the check every allocation sized by an input goes through first.

use crate::error::{Error, Result};

/// Refuses to allocate `bytes` for `what` when they are more than the memory available (where
/// the machine says how much that is): a size read from a file or the command line must not
/// abort the process on a failed allocation.
pub fn check_alloc(bytes: u64, what: &str) -> Result<()> {
    if let Some(avail) = available_memory_bytes() {
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

/// `MemAvailable` from `/proc/meminfo`, in bytes.
pub fn available_memory_bytes() -> Option<u64> {
    let s = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = s.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
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
