//! `pleat launch DIR`: runs a compiled directory's ranks as threads of this process, each by
//! calling the entry function (`pleat_rank_main`) of its library `DIR/rank<i>.so`
//! (`pleat compile --emit so`), over the threads communicator; reports as `pleat run` does.
//!
//! Guarantee: nothing is interpreted as a whole program. Every rank must have a library with an
//! entry function generated for its program, or the launch is refused before any rank starts.

use anyhow::{bail, Result};

use crate::model_arg::{resolve, ModelSource};
use crate::native::ExecutionPath;
use crate::run::RunArgs;
use crate::usage::UsageError;

/// Runs `pleat launch` (`pleat run`'s flags; MODEL must be a compiled directory with libraries).
pub fn launch(args: &RunArgs) -> Result<()> {
    let not_launchable = |reason: String| UsageError::NotLaunchable { dir: args.model.clone(), reason };
    crate::run::check_warmup(args)?;
    crate::run::check_outputs(args)?;
    if args.training.train {
        bail!(not_launchable("--train runs through `pleat run`; launch runs a compiled forward pass".into()));
    }
    #[cfg(feature = "mpi")]
    if args.comm == crate::run::CommChoice::Mpi {
        bail!(not_launchable(
            "launch calls the libraries' entry functions on threads; --comm mpi runs `pleat run`".into()
        ));
    }
    let ModelSource::Compiled(dir) = resolve(&args.model)? else {
        bail!(not_launchable("it is not a compiled directory (`pleat compile ... --emit so --out DIR`)".into()));
    };
    let programs = crate::compiled_dir::CompiledDir::read_forward(&dir)?.programs;
    let libraries = crate::native::load(&dir, &programs)?;
    for (rank, library) in libraries.iter().enumerate() {
        match ExecutionPath::of(library.as_ref()) {
            ExecutionPath::NativeEntry => {}
            ExecutionPath::Bytecode | ExecutionPath::NativeExecutable => {
                // Rank executables run as processes, which `pleat run DIR` starts under mpirun.
                let hint = if dir.join(format!("rank{rank}")).is_file() {
                    "; it has rank executables (--emit exe), which `pleat run DIR` starts under mpirun"
                } else {
                    ""
                };
                bail!(not_launchable(format!("rank {rank} has no library rank{rank}.so{hint}")))
            }
            ExecutionPath::NativeKernels => {
                bail!(not_launchable(format!("rank{rank}.so has no entry function (an older pleat wrote it)")))
            }
        }
    }
    crate::run::run(args)
}
