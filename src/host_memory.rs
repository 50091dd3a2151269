//! This machine's memory, from `/proc/meminfo`: its size for `pleat bench calibrate`, and what is
//! free before pleat allocates a run's buffers, so that a run too large for it is an error and not
//! an aborted allocation.

use anyhow::{bail, Context, Result};

use crate::usage::UsageError;

/// A `/proc/meminfo` field (`MemTotal`, `MemAvailable`), in bytes.
fn meminfo_bytes(field: &str) -> Result<u64> {
    let meminfo = std::fs::read_to_string("/proc/meminfo").context("cannot read /proc/meminfo for the memory size")?;
    let kib = meminfo
        .lines()
        .find_map(|line| line.strip_prefix(field)?.strip_prefix(':'))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .with_context(|| format!("/proc/meminfo has no {field} line"))?;
    Ok(kib.saturating_mul(1024))
}

/// This machine's memory.
pub fn total_bytes() -> Result<u64> {
    meminfo_bytes("MemTotal")
}

/// Refuses `what` (a run, a benchmark) needing `needed` bytes when this machine has fewer
/// available; without a `/proc/meminfo` (not Linux) it lets the run try.
pub fn ensure_available(what: &str, needed: u64) -> Result<()> {
    let Ok(available) = meminfo_bytes("MemAvailable") else {
        return Ok(());
    };
    if needed > available {
        bail!(UsageError::NotEnoughMemory { what: what.to_string(), needed, available });
    }
    Ok(())
}
