//! Reading Chrome trace-event files from tests: the events, and whether a rank's transfers ran
//! beside its kernels.

#![allow(dead_code, reason = "each test binary uses a different part")]

use std::collections::BTreeMap;
use std::path::Path;

use serde_json::Value;

/// Each track's slices: (start, duration, name), keyed by (pid, tid).
pub type Tracks = BTreeMap<(u64, u64), Vec<(f64, f64, String)>>;

/// The events of the trace at `path`.
pub fn read(path: &Path) -> Vec<Value> {
    let text = std::fs::read_to_string(path).expect("the trace file exists");
    let document: Value = serde_json::from_str(&text).expect("the trace is JSON");
    document["traceEvents"].as_array().expect("traceEvents").clone()
}

/// Whether, on some rank, a transfer on a comm track runs while a kernel (not a wait or a load)
/// runs on the compute track.
pub fn some_rank_overlaps(events: &[Value]) -> bool {
    let mut tracks: Tracks = BTreeMap::new();
    for event in events.iter().filter(|event| event["ph"] == "X") {
        let key = (event["pid"].as_u64().unwrap(), event["tid"].as_u64().unwrap());
        let name = event["name"].as_str().unwrap().to_string();
        tracks.entry(key).or_default().push((event["ts"].as_f64().unwrap(), event["dur"].as_f64().unwrap(), name));
    }
    // Either communication track (1 the main stream, 2 the prefetches) against the compute track.
    tracks.iter().filter(|((_, tid), _)| *tid != 0).any(|((pid, _), transfers)| {
        let kernels = tracks.get(&(*pid, 0)).map(Vec::as_slice).unwrap_or_default();
        transfers.iter().any(|(start, duration, _)| {
            kernels.iter().filter(|(_, _, name)| !name.starts_with("wait ") && !name.starts_with("load ")).any(
                // More than a nanosecond in common: slices that only touch differ by rounding.
                |(kernel_start, kernel_duration, _)| {
                    (kernel_start + kernel_duration).min(start + duration) - kernel_start.max(*start) > 1e-3
                },
            )
        })
    })
}

/// Panics unless each of ranks `0..ranks` has a slice on its compute (0) and its comm (1) track.
#[track_caller]
pub fn assert_every_rank_has_both_tracks(events: &[Value], ranks: u64, what: &str) {
    for rank in 0..ranks {
        for tid in [0, 1] {
            assert!(
                events.iter().any(|event| event["ph"] == "X" && event["pid"] == rank && event["tid"] == tid),
                "{what}: rank {rank} has no slice on thread {tid}"
            );
        }
    }
}
