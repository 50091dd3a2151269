//! `pleat run --comm mpi`: the run's rank programs as MPI processes, one a rank, that pleat starts
//! itself: it compiles the model into a scratch directory (or takes a compiled one) and runs
//! `mpirun -np N pleat rank DIR`, whose rank 0 prints the report. The same programs, tokens and
//! weights as `--comm threads`, so the logits and the bytes each rank sends are the same.

use std::process::Stdio;

use anyhow::{bail, Context, Result};

use crate::compile::{Kernels, ModelOnMesh};
use crate::compiled_dir::{write_compiled, CompiledDir, CompiledFiles};
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
    let given_tokens = args.tokens.as_ref().map(|path| read_tokens(path)).transpose()?;
    let (dir, weights, ranks, batch, seq) = match resolve(&args.model)? {
        ModelSource::Compiled(dir) => {
            if args.precision.is_some() {
                bail!(UsageError::PrecisionOfCompiled { dir: dir.display().to_string() });
            }
            let CompiledDir { plan, programs, .. } = CompiledDir::read_forward(&dir)?;
            args.check_against_plan(&plan)?;
            // Every rank is a process of this machine: they need what the threads would.
            crate::run::ensure_threads_fit(&programs)?;
            let weights = crate::compiled_dir::weights_for(args.weights.as_deref(), &dir, &plan)?;
            (dir, weights, plan.ranks, plan.batch, plan.seq)
        }
        ModelSource::Config { config, weights } => {
            let (batch, seq) = args.sizes(given_tokens.as_ref());
            let target = ModelOnMesh {
                model: args.model.clone(),
                mesh: args.mesh.clone(),
                strategy: args.strategy,
                batch,
                seq,
                no_overlap: args.no_overlap,
                comm_streams: 2,
            };
            let config = args.precision.unwrap_or_default().apply(&config);
            let compiled = target.compile(&config, pleat_passes::Dump::Nothing, Kernels::Interpreted)?;
            crate::run::ensure_threads_fit(&compiled.programs)?;
            let dir = scratch.path().join("compiled");
            write_compiled(
                &dir,
                &CompiledFiles::forward(&config, &compiled, (batch, seq), target.strategy.name()),
                |_| Ok(Vec::new()),
            )?;
            (dir, args.weights.clone().or(weights), compiled.programs.len() as u32, batch, seq)
        }
    };
    // Refused here once rather than by every rank.
    if let Some(tokens) = &given_tokens {
        tokens.expect_shape(batch, seq)?;
    }
    let mut command = crate::exe::mpirun();
    command.args(["-np", &ranks.to_string()]);
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
