//! `pleat run --comm mpi`: the run's rank programs as MPI processes, one a rank, that pleat starts
//! itself: it compiles the model into a scratch directory (or takes a compiled one) and runs
//! `mpirun -np N pleat rank DIR`, whose rank 0 prints the report. The same programs, tokens and
//! weights as `--comm threads`, so the logits and the bytes each rank sends are the same.

use std::process::Stdio;

use anyhow::{bail, Context, Result};

use crate::compile::{read_compiled, write_compiled, Kernels, ModelOnMesh};
use crate::device::Device;
use crate::inputs::read_tokens;
use crate::model_arg::{resolve, ModelSource};
use crate::run::RunArgs;
use crate::scratch::ScratchDir;
use crate::usage::UsageError;

/// Runs `args` under `mpirun`; the job's report is rank 0's, on this process's stdout.
pub fn run_under_mpi(args: &RunArgs) -> Result<()> {
    // `pleat rank` runs a compiled forward pass with the bytecode interpreter on the CPU.
    let refused = [
        ("--train", args.training.train),
        ("--native", args.native),
        ("--device cuda", args.device == Device::Cuda),
        ("--emulate-link", args.emulate_link.is_some()),
    ];
    if let Some((flag, _)) = refused.iter().find(|(_, given)| *given) {
        bail!(UsageError::NotUnderMpi { flag });
    }
    let scratch = ScratchDir::new("mpi")?;
    let (dir, weights) = match resolve(&args.model)? {
        ModelSource::Compiled(dir) => {
            if args.precision.is_some() {
                bail!(UsageError::PrecisionOfCompiled { dir: dir.display().to_string() });
            }
            let (plan, _, _) = read_compiled(&dir)?;
            for (flag, given, planned) in [("--batch", args.batch, plan.batch), ("--seq", args.seq, plan.seq)] {
                if given.is_some_and(|given| given != planned) {
                    bail!(UsageError::DiffersFromPlan { flag, given: given.unwrap_or(0), planned });
                }
            }
            (dir, args.weights.clone())
        }
        ModelSource::Config { config, weights } => {
            let given_tokens = args.tokens.as_ref().map(|path| read_tokens(path)).transpose()?;
            let target = ModelOnMesh {
                model: args.model.clone(),
                mesh: args.mesh.clone(),
                strategy: args.strategy,
                batch: args.batch.or(given_tokens.as_ref().map(|tokens| tokens.batch)).unwrap_or(8),
                seq: args.seq.or(given_tokens.as_ref().map(|tokens| tokens.seq)).unwrap_or(64),
                no_overlap: args.no_overlap,
                comm_streams: 2,
            };
            let config = args.precision.unwrap_or_default().apply(&config);
            let compiled = target.compile(&config, pleat_passes::Dump::Nothing, Kernels::Interpreted)?;
            let dir = scratch.path().join("compiled");
            write_compiled(&dir, &config, &compiled, target.batch, target.seq, target.strategy.name())?;
            (dir, args.weights.clone().or(weights))
        }
    };
    let (plan, _, _) = read_compiled(&dir)?;
    // Refused here once rather than by every rank.
    if let Some(path) = &args.tokens {
        read_tokens(path)?.expect_shape(plan.batch, plan.seq)?;
    }
    let mut command = crate::exe::mpirun();
    command.args(["-np", &plan.ranks.to_string()]);
    command.arg(std::env::current_exe().context("cannot find the pleat executable to start under mpirun")?);
    command.arg("rank").arg(&dir);
    command.args(["--seed", &args.seed.to_string(), "--timeout", &args.timeout.to_string()]);
    command.args(["--format", if args.format == crate::run::Format::Json { "json" } else { "text" }]);
    if args.check {
        command.arg("--check");
    }
    let paths = [
        ("--weights", weights.as_ref()),
        ("--tokens", args.tokens.as_ref()),
        ("--trace", args.trace.as_ref()),
        ("--logits-out", args.logits_out.as_ref()),
    ];
    for (flag, path) in paths {
        if let Some(path) = path {
            command.arg(flag).arg(std::path::absolute(path)?);
        }
    }
    let status = command
        .stdin(Stdio::null())
        .status()
        .map_err(|error| UsageError::MpirunMissing { reason: error.to_string() })?;
    if !status.success() {
        bail!(UsageError::MpiJobFailed { status: status.to_string() });
    }
    Ok(())
}
