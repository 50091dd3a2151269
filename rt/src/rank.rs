//! One rank executable's run: its program, its inputs, the MPI job, the entry function, its outcome.

use std::path::{Path, PathBuf};
use std::time::Instant;

use pleat_backend::native::program_fingerprint;
use pleat_backend::Program;
use pleat_runtime::comm::{gemm_threads_per_process, Communicator, MpiComm};
use pleat_runtime::native::EntryFunction;
use pleat_runtime::weights::{SafetensorsWeights, SeededWeights, WeightSource};
use pleat_runtime::RunInputs;

use crate::args::ExeArgs;
use crate::error::ExeError;

/// Runs rank `rank` of the compiled directory through `entry`, which was generated for the program
/// whose fingerprint is `fingerprint`, and writes its outcome into `args.out`.
///
/// Everything that every rank can check alone (files, fingerprints, token shapes) is checked before
/// MPI starts; a failure after it ends the whole job (`MPI_Abort`) so that no peer waits for this rank.
pub fn run_rank(args: &ExeArgs, rank: u32, entry: EntryFunction, fingerprint: u64) -> Result<(), ExeError> {
    let dir = match &args.dir {
        Some(dir) => dir.clone(),
        None => executable_dir()?,
    };
    let program = read_program(&dir, rank)?;
    if program_fingerprint(&program) != fingerprint {
        return Err(ExeError::Mismatch(format!(
            "rank{rank} was generated for another program than {}; compile the directory again with \
             `pleat compile ... --emit exe`",
            dir.join(format!("rank{rank}.program")).display()
        )));
    }
    let tokens = read_tokens(&args.tokens, &program.tokens_shape)?;
    let weights: Box<dyn WeightSource> = match &args.weights {
        Some(path) => Box::new(
            SafetensorsWeights::open(path)
                .map_err(|error| ExeError::Read { path: path.clone(), reason: error.to_string() })?,
        ),
        None => Box::new(SeededWeights::new(args.seed)),
    };
    std::fs::create_dir_all(&args.out)
        .map_err(|error| ExeError::Output { path: args.out.clone(), reason: error.to_string() })?;
    let mut comm = MpiComm::init(args.timeout).map_err(|error| ExeError::Mpi(error.to_string()))?;
    if comm.rank() != rank || comm.world_size() != program.world_size {
        // Another process may be the right one (the same executable started twice, say) and would
        // wait for this one: end the whole job.
        let error = ExeError::Mismatch(format!(
            "this executable is rank {rank} of {} but mpirun started it as rank {} of {}; launch every rank \
             in order: mpirun -np 1 DIR/rank0 ARGS : -np 1 DIR/rank1 ARGS ... (or `pleat run DIR`)",
            program.world_size,
            comm.rank(),
            comm.world_size()
        ));
        crate::report_abort(rank, &error);
        comm.abort_job(&format!("rank{rank}: {error}"), 1);
    }
    let seq = program.tokens_shape.get(1).copied().unwrap_or(0);
    let positions: Vec<u32> = (0..seq as u32).collect();
    let inputs = RunInputs { tokens: &tokens, positions: &positions, weights: weights.as_ref(), epoch: Instant::now() };
    let outcome =
        pleat_runtime::capi::execute_entry_function(&program, &mut comm, &inputs, gemm_threads_per_process(), entry)
            .map_err(ExeError::from)
            .and_then(|outcome| Ok(pleat_runtime::outcome_file::write_outcome(&args.out, &outcome)?));
    if let Err(error) = outcome {
        // Peers may be blocked where only MPI_Abort reaches them: end the job, naming the cause.
        crate::report_abort(rank, &error);
        comm.abort_job(&format!("rank {rank} failed: {error}"), 1);
    }
    comm.flush().map_err(|error| ExeError::Flush(error.to_string()))?;
    Ok(())
}

/// The directory of the running executable.
fn executable_dir() -> Result<PathBuf, ExeError> {
    let exe = std::env::current_exe()
        .map_err(|error| ExeError::Read { path: "/proc/self/exe".into(), reason: error.to_string() })?;
    Ok(exe.parent().map_or_else(|| PathBuf::from("."), Path::to_path_buf))
}

/// `dir/rank<rank>.program`, which must be rank `rank`'s.
fn read_program(dir: &Path, rank: u32) -> Result<Program, ExeError> {
    let path = dir.join(format!("rank{rank}.program"));
    let unreadable = |reason: String| ExeError::Read { path: path.clone(), reason };
    let text = std::fs::read_to_string(&path).map_err(|error| unreadable(error.to_string()))?;
    let program = pleat_backend::from_json(&text).map_err(|error| unreadable(error.to_string()))?;
    if program.rank != rank {
        return Err(unreadable(format!("it is rank {}'s program, not rank {rank}'s", program.rank)));
    }
    Ok(program)
}

/// The token ids of `path` (JSON rows, `[[id, ...], ...]`), which must be `shape` (`[batch, seq]`),
/// flattened row by row.
fn read_tokens(path: &Path, shape: &[u64]) -> Result<Vec<u32>, ExeError> {
    let unreadable = |reason: String| ExeError::Read { path: path.to_path_buf(), reason };
    let text = std::fs::read_to_string(path).map_err(|error| unreadable(error.to_string()))?;
    let wrong = |reason: String| ExeError::Tokens { path: path.to_path_buf(), reason };
    let rows: Vec<Vec<u32>> = serde_json::from_str(&text)
        .map_err(|error| wrong(format!("{error}; write the ids as JSON rows, [[id, ...], ...]")))?;
    let (batch, seq) = (shape.first().copied().unwrap_or(0), shape.get(1).copied().unwrap_or(0));
    if rows.len() as u64 != batch || rows.iter().any(|row| row.len() as u64 != seq) {
        let lengths: Vec<usize> = rows.iter().map(Vec::len).collect();
        return Err(wrong(format!(
            "the plan takes {batch} rows of {seq} ids, the file holds {} rows of {lengths:?} ids",
            rows.len()
        )));
    }
    Ok(rows.into_iter().flatten().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("pleat-rt-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a scratch directory");
        dir
    }

    #[test]
    fn tokens_must_have_the_plans_shape() {
        let dir = scratch("tokens");
        let path = dir.join("tokens.json");
        std::fs::write(&path, "[[1, 2, 3], [4, 5, 6]]").expect("written");
        assert_eq!(read_tokens(&path, &[2, 3]).expect("the plan's shape"), vec![1, 2, 3, 4, 5, 6]);
        let error = read_tokens(&path, &[2, 4]).expect_err("rows too short");
        assert!(error.to_string().contains("the plan takes 2 rows of 4 ids"), "{error}");
        // A file of the wrong batch is E0555, not "cannot read" (E0549), whose help is to check
        // that the file exists.
        assert!(matches!(error, ExeError::Tokens { .. }), "{error:?}");
        std::fs::write(&path, "[1, 2]").expect("written");
        let error = read_tokens(&path, &[1, 2]).expect_err("not rows");
        assert!(error.to_string().contains("JSON rows"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_missing_program_names_its_file() {
        let dir = scratch("program");
        let error = read_program(&dir, 1).expect_err("no program");
        assert!(error.to_string().contains("rank1.program"), "{error}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
