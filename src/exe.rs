//! `pleat run DIR` of a directory whose ranks are executables (`pleat compile --emit exe`): one
//! process a rank, started by mpirun (`mpirun -np 1 DIR/rank0 ARGS : -np 1 DIR/rank1 ARGS ...`),
//! each running its program through its generated entry function over MPI and writing its outcome
//! (`pleat_runtime::outcome_file`), which this process reads back.
//!
//! Guarantee: either every rank ran and its outcome was read, or the run is an error that carries
//! what the ranks reported; a rank that fails ends the whole job (the static runtime aborts it), so
//! nothing waits forever.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Result};
use pleat_backend::Program;
use pleat_runtime::RankOutcome;

use crate::inputs::Tokens;
use crate::usage::UsageError;

/// The lines of the ranks' report an error keeps.
const REPORT_LINES: usize = 30;

/// Each rank's executable `DIR/rank<i>`, when the directory has them; an error when only some ranks
/// have one.
pub fn executables(dir: &Path, programs: &[Program]) -> Result<Option<Vec<PathBuf>>> {
    let paths: Vec<PathBuf> = programs.iter().map(|program| dir.join(format!("rank{}", program.rank))).collect();
    let present: Vec<bool> = paths.iter().map(|path| path.is_file()).collect();
    if !present.contains(&true) {
        return Ok(None);
    }
    if let Some(rank) = present.iter().position(|&here| !here) {
        bail!(UsageError::ExecutablesIncomplete { dir: dir.display().to_string(), rank: rank as u32 });
    }
    Ok(Some(paths.iter().map(std::path::absolute).collect::<std::io::Result<_>>()?))
}

/// What the rank executables are given besides the tokens.
pub struct ExeInputs<'a> {
    /// Weights' file or directory (`None`: seeded synthetic weights).
    pub weights: Option<&'a Path>,
    /// Seed of the synthetic weights.
    pub seed: u64,
    /// Seconds a rank waits on a message.
    pub timeout: u64,
}

/// Runs `executables` (rank `i` at index `i`) of `dir` under mpirun on `tokens`; every rank's outcome.
pub fn run_executables(
    dir: &Path,
    executables: &[PathBuf],
    tokens: &Tokens,
    inputs: &ExeInputs,
) -> Result<Vec<RankOutcome>> {
    let failed = |reason: String| UsageError::ExecutablesFailed { dir: dir.display().to_string(), reason };
    if inputs.weights.is_some_and(crate::checkpoint::is_checkpoint) {
        bail!(failed(
            "a training checkpoint's weights are assembled by pleat itself; run the directory compiled with \
             --emit so (threads) or without --emit, or pass a .safetensors file"
                .into()
        ));
    }
    let scratch = crate::scratch::ScratchDir::new("exe")?;
    Ok(run_in(dir, executables, tokens, inputs, scratch.path()).map_err(failed)?)
}

/// `mpirun` as pleat starts it on this machine: more ranks than cores allowed (one process a rank).
pub fn mpirun() -> Command {
    let mut command = Command::new("mpirun");
    command.arg("--oversubscribe");
    // Open MPI refuses root unless told twice; containers often forbid the cross-process copy its
    // shared-memory transport prefers. A caller's own setting wins.
    for (name, value) in [
        ("OMPI_ALLOW_RUN_AS_ROOT", "1"),
        ("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1"),
        ("OMPI_MCA_btl_vader_single_copy_mechanism", "none"),
    ] {
        if std::env::var_os(name).is_none() {
            command.env(name, value);
        }
    }
    command
}

/// [`run_executables`] with its files in `scratch`; the reason of a failure.
fn run_in(
    dir: &Path,
    executables: &[PathBuf],
    tokens: &Tokens,
    inputs: &ExeInputs,
    scratch: &Path,
) -> Result<Vec<RankOutcome>, String> {
    let rows: Vec<&[u32]> = tokens.ids.chunks(tokens.seq.max(1) as usize).collect();
    let tokens_path = scratch.join("tokens.json");
    let text = serde_json::to_string(&rows).map_err(|error| error.to_string())?;
    std::fs::write(&tokens_path, text).map_err(|error| format!("cannot write {}: {error}", tokens_path.display()))?;
    let dir = std::path::absolute(dir).map_err(|error| error.to_string())?;
    let mut args: Vec<String> = vec!["--dir".into(), dir.display().to_string()];
    args.extend(["--tokens".into(), tokens_path.display().to_string(), "--out".into(), scratch.display().to_string()]);
    args.extend(["--seed".into(), inputs.seed.to_string(), "--timeout".into(), inputs.timeout.to_string()]);
    if let Some(weights) = inputs.weights {
        let weights = std::path::absolute(weights).map_err(|error| error.to_string())?;
        args.extend(["--weights".into(), weights.display().to_string()]);
    }
    let mut command = mpirun();
    for (rank, executable) in executables.iter().enumerate() {
        if rank > 0 {
            command.arg(":");
        }
        command.args(["-np", "1"]).arg(executable).args(&args);
    }
    let output = command.output().map_err(|error| {
        format!("cannot start mpirun ({error}); install Open MPI (openmpi-bin), or compile with --emit so to run the ranks as threads")
    })?;
    if !output.status.success() {
        let report = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
        let lines: Vec<&str> = report.lines().collect();
        let tail = lines[lines.len().saturating_sub(REPORT_LINES)..].join("\n");
        return Err(format!("mpirun exited with {}; the ranks reported:\n{tail}", output.status));
    }
    (0..executables.len() as u32)
        .map(|rank| pleat_runtime::outcome_file::read_outcome(scratch, rank).map_err(|error| error.to_string()))
        .collect()
}
