//! `pleat compile --emit`: native code for each rank through LLVM (feature `llvm`): its elementwise
//! and row-wise kernels and an entry function that runs the whole program; and `pleat run`'s loading
//! of the shared libraries it writes, with the path each rank takes ([`ExecutionPath`]).
//!
//! Without the `llvm` feature, `--emit` is refused with an error that says so; loading libraries
//! that a build with the feature wrote needs no LLVM.

use std::path::Path;

use anyhow::Result;
use pleat_backend::Program;
use pleat_runtime::NativeKernels;

/// What `--emit` writes, as `DIR/rank<i>.<ext>`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Emit {
    /// Optimized LLVM IR text (`.ll`).
    LlvmIr,
    /// Host assembly (`.s`).
    Asm,
    /// A host object file (`.o`).
    Obj,
    /// A host shared library (`.so`) that `pleat run DIR` loads; its entry function runs the rank.
    So,
    /// PTX for sm_80 and sm_90 (`.sm_80.ptx`, `.sm_90.ptx`).
    Ptx,
}

/// Refuses `--emit` when pleat was built without LLVM, before any work is done.
pub fn check_available(emit: &[Emit]) -> Result<()> {
    if !emit.is_empty() && !cfg!(feature = "llvm") {
        anyhow::bail!(crate::usage::UsageError::NativeUnavailable);
    }
    Ok(())
}

/// Reorders each program so that residual adds fuse with the RMSNorm after them (a weight's load
/// moves before the add); returns the loads moved.
pub fn schedule(programs: &mut [Program]) -> usize {
    programs.iter_mut().map(pleat_backend::native::schedule_for_fusion).sum()
}

/// Writes every `emit` artifact for every program into `dir`; returns the file names written.
#[cfg(feature = "llvm")]
pub fn emit(programs: &[Program], emit: &[Emit], target_cpu: Option<&str>, dir: &Path) -> Result<Vec<String>> {
    use pleat_backend::llvm::{Artifact, CodegenOptions};
    let options = CodegenOptions { target_cpu: target_cpu.map(str::to_string) };
    let mut written = Vec::new();
    for &kind in emit {
        let artifact = match kind {
            Emit::LlvmIr => Artifact::LlvmIr,
            Emit::Asm => Artifact::Asm,
            Emit::Obj => Artifact::Object,
            Emit::So => Artifact::SharedLibrary,
            Emit::Ptx => Artifact::Ptx,
        };
        for program in programs {
            let paths = pleat_backend::llvm::emit(program, artifact, &options, dir)?;
            written
                .extend(paths.iter().map(|path| path.file_name().unwrap_or_default().to_string_lossy().into_owned()));
        }
    }
    Ok(written)
}

/// Without LLVM: `check_available` has already refused any `--emit`.
#[cfg(not(feature = "llvm"))]
pub fn emit(_programs: &[Program], emit: &[Emit], _target_cpu: Option<&str>, _dir: &Path) -> Result<Vec<String>> {
    check_available(emit)?;
    Ok(Vec::new())
}

/// How a rank's program ran.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ExecutionPath {
    /// The executor interpreted every instruction.
    Bytecode,
    /// The executor interpreted the program, calling the library's kernels (a library without an
    /// entry function).
    NativeKernels,
    /// The library's entry function (`pleat_rank_main`) ran the program, calling the runtime's C ABI.
    NativeEntry,
}

impl ExecutionPath {
    /// The path a rank with `library` takes (`pleat_runtime::execute_native`'s choice).
    pub fn of(library: Option<&NativeKernels>) -> Self {
        match library {
            None => ExecutionPath::Bytecode,
            Some(library) if library.entry().is_some() => ExecutionPath::NativeEntry,
            Some(_) => ExecutionPath::NativeKernels,
        }
    }

    /// Its name in reports.
    pub fn name(self) -> &'static str {
        match self {
            ExecutionPath::Bytecode => "bytecode",
            ExecutionPath::NativeKernels => "bytecode+native-kernels",
            ExecutionPath::NativeEntry => "native-entry",
        }
    }
}

/// Each rank's native kernels from `DIR/rank<i>.so`, where that file exists.
pub fn load(dir: &Path, programs: &[Program]) -> Result<Vec<Option<NativeKernels>>> {
    programs
        .iter()
        .map(|program| {
            let path = dir.join(format!("rank{}.so", program.rank));
            if !path.exists() {
                return Ok(None);
            }
            // A relative path would make the loader search the library path instead of `dir`.
            let path = std::path::absolute(&path)?;
            Ok(Some(NativeKernels::open(&path, program)?))
        })
        .collect()
}
