//! A rank's [`RankOutcome`] as files, for ranks that run as processes of their own (the rank
//! executables `pleat compile --emit exe` links, launched by mpirun): `rank<i>.outcome.json` holds
//! everything but the output blocks' values, which `rank<i>.outcome.safetensors` holds (tensor
//! `output<k>` for the k-th block, shaped as its region).
//!
//! Guarantee: [`read_outcome`] returns exactly the outcome [`write_outcome`] was given (f32 values
//! bit for bit), or an error naming the file; a file of another rank is refused.

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::comm::{CollectiveKind, CommStats};
use crate::executor::{OutputBlock, RankOutcome};
use crate::weights::{write_safetensors, SafetensorsWeights, WeightSource};

/// Writing or reading an outcome's files failed.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
#[error("rank outcome file {path}: {reason}")]
#[diagnostic(code(E0536), help("run the rank again; the file is written by the rank executable at its end"))]
pub struct OutcomeFileError {
    /// The file.
    pub path: PathBuf,
    /// What is wrong with it.
    pub reason: String,
}

/// Everything of a [`RankOutcome`] but its blocks' values.
#[derive(Serialize, Deserialize)]
struct Summary {
    rank: u32,
    peak_bytes: u64,
    param_bytes: u64,
    /// Bytes sent, in [`CollectiveKind::ALL`] order.
    comm_bytes: Vec<u64>,
    activation_bytes: Vec<u64>,
    in_flight_peak_bytes: u64,
    timings: Vec<(u64, u64)>,
    max_expert_rows: u64,
    arena_bytes: u64,
    /// Absent from the outcomes of executables built before a rank could have two streams, which
    /// had one.
    #[serde(default)]
    prefetch_stream: bool,
    blocks: Vec<BlockPlace>,
}

/// Where an output block lies.
#[derive(Serialize, Deserialize)]
struct BlockPlace {
    index: u32,
    shape: Vec<u64>,
    region: Vec<(u64, u64)>,
}

/// The summary's path for `rank` in `dir`.
fn summary_path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("rank{rank}.outcome.json"))
}

/// The values' path for `rank` in `dir`.
fn values_path(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("rank{rank}.outcome.safetensors"))
}

/// Writes `outcome` into `dir` as `rank<i>.outcome.json` and `rank<i>.outcome.safetensors`.
pub fn write_outcome(dir: &Path, outcome: &RankOutcome) -> Result<(), OutcomeFileError> {
    let values = values_path(dir, outcome.rank);
    let tensors: Vec<(String, Vec<u64>, Vec<f32>)> = outcome
        .outputs
        .iter()
        .enumerate()
        .map(|(k, block)| {
            (format!("output{k}"), block.region.iter().map(|&(_, len)| len).collect(), block.data.clone())
        })
        .collect();
    write_safetensors(&values, &tensors)
        .map_err(|error| OutcomeFileError { path: values.clone(), reason: error.to_string() })?;
    let summary = Summary {
        rank: outcome.rank,
        peak_bytes: outcome.peak_bytes,
        param_bytes: outcome.param_bytes,
        comm_bytes: CollectiveKind::ALL.iter().map(|&kind| outcome.comm.bytes(kind)).collect(),
        activation_bytes: outcome.activation_bytes.clone(),
        in_flight_peak_bytes: outcome.in_flight_peak_bytes,
        timings: outcome.timings.clone(),
        max_expert_rows: outcome.max_expert_rows,
        arena_bytes: outcome.arena_bytes,
        prefetch_stream: outcome.prefetch_stream,
        blocks: outcome
            .outputs
            .iter()
            .map(|block| BlockPlace { index: block.index, shape: block.shape.clone(), region: block.region.clone() })
            .collect(),
    };
    let path = summary_path(dir, outcome.rank);
    let text = serde_json::to_string(&summary)
        .map_err(|error| OutcomeFileError { path: path.clone(), reason: error.to_string() })?;
    std::fs::write(&path, text).map_err(|error| OutcomeFileError { path, reason: error.to_string() })
}

/// Reads the outcome of `rank` that [`write_outcome`] wrote into `dir`.
pub fn read_outcome(dir: &Path, rank: u32) -> Result<RankOutcome, OutcomeFileError> {
    let path = summary_path(dir, rank);
    let failed = |path: &Path, reason: String| OutcomeFileError { path: path.to_path_buf(), reason };
    let text = std::fs::read_to_string(&path).map_err(|error| failed(&path, error.to_string()))?;
    let summary: Summary = serde_json::from_str(&text).map_err(|error| failed(&path, error.to_string()))?;
    if summary.rank != rank {
        return Err(failed(&path, format!("it holds rank {}'s outcome, not rank {rank}'s", summary.rank)));
    }
    if summary.comm_bytes.len() != CollectiveKind::ALL.len() {
        return Err(failed(
            &path,
            format!(
                "it counts {} kinds of collective, this runtime {}",
                summary.comm_bytes.len(),
                CollectiveKind::ALL.len()
            ),
        ));
    }
    let mut comm = CommStats::default();
    for (&kind, &bytes) in CollectiveKind::ALL.iter().zip(&summary.comm_bytes) {
        comm.add(kind, bytes);
    }
    let values = values_path(dir, rank);
    let file = SafetensorsWeights::open(&values).map_err(|error| failed(&values, error.to_string()))?;
    let outputs = summary
        .blocks
        .into_iter()
        .enumerate()
        .map(|(k, place)| {
            let dims: Vec<u64> = place.region.iter().map(|&(_, len)| len).collect();
            let whole: Vec<(u64, u64)> = dims.iter().map(|&len| (0, len)).collect();
            let data =
                file.read(&format!("output{k}"), &dims, &whole).map_err(|error| failed(&values, error.to_string()))?;
            Ok(OutputBlock { index: place.index, shape: place.shape, region: place.region, data })
        })
        .collect::<Result<Vec<_>, OutcomeFileError>>()?;
    Ok(RankOutcome {
        rank,
        outputs,
        peak_bytes: summary.peak_bytes,
        param_bytes: summary.param_bytes,
        comm,
        activation_bytes: summary.activation_bytes,
        in_flight_peak_bytes: summary.in_flight_peak_bytes,
        timings: summary.timings,
        max_expert_rows: summary.max_expert_rows,
        arena_bytes: summary.arena_bytes,
        prefetch_stream: summary.prefetch_stream,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(rank: u32) -> RankOutcome {
        let mut comm = CommStats::default();
        comm.add(CollectiveKind::AllGather, 4096);
        comm.add(CollectiveKind::SendRecv, 12);
        RankOutcome {
            rank,
            outputs: vec![
                OutputBlock {
                    index: 0,
                    shape: vec![2, 3, 4],
                    region: vec![(0, 2), (1, 2), (0, 4)],
                    // Values that a decimal round trip would not keep.
                    data: (0..16).map(|i| (i as f32 + 0.1).recip() * std::f32::consts::PI).collect(),
                },
                OutputBlock { index: 1, shape: vec![1], region: vec![(0, 1)], data: vec![-0.0] },
            ],
            peak_bytes: 1 << 20,
            param_bytes: 4096,
            comm,
            activation_bytes: vec![0, 64, 32],
            in_flight_peak_bytes: 7,
            timings: vec![(1, 2), (3, 5), (8, 13)],
            max_expert_rows: 3,
            arena_bytes: 1 << 16,
            prefetch_stream: true,
        }
    }

    fn same(left: &RankOutcome, right: &RankOutcome) -> bool {
        let blocks_equal = left.outputs.len() == right.outputs.len()
            && left.outputs.iter().zip(&right.outputs).all(|(a, b)| {
                a.index == b.index
                    && a.shape == b.shape
                    && a.region == b.region
                    && a.data.iter().map(|v| v.to_bits()).eq(b.data.iter().map(|v| v.to_bits()))
            });
        blocks_equal
            && left.rank == right.rank
            && left.peak_bytes == right.peak_bytes
            && left.param_bytes == right.param_bytes
            && left.comm == right.comm
            && left.activation_bytes == right.activation_bytes
            && left.in_flight_peak_bytes == right.in_flight_peak_bytes
            && left.timings == right.timings
            && left.max_expert_rows == right.max_expert_rows
            && left.arena_bytes == right.arena_bytes
            && left.prefetch_stream == right.prefetch_stream
    }

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pleat-outcome-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    }

    #[test]
    fn an_outcome_reads_back_bit_for_bit() {
        let dir = scratch("round-trip");
        let written = outcome(3);
        write_outcome(&dir, &written).expect("written");
        let read = read_outcome(&dir, 3).expect("read");
        assert!(same(&written, &read), "{read:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn another_ranks_file_and_a_missing_one_are_refused() {
        let dir = scratch("refused");
        write_outcome(&dir, &outcome(1)).expect("written");
        std::fs::rename(summary_path(&dir, 1), summary_path(&dir, 2)).expect("renamed");
        let error = read_outcome(&dir, 2).expect_err("rank 1's summary under rank 2's name");
        assert!(error.reason.contains("rank 1's outcome"), "{error}");
        let error = read_outcome(&dir, 0).expect_err("no file");
        assert!(error.path.ends_with("rank0.outcome.json"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
