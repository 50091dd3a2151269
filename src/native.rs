//! `pleat compile --emit`: native code for each rank through LLVM (feature `llvm`): its elementwise
//! and row-wise kernels and an entry function that runs the whole program, as a shared library or as
//! an executable linked with the static runtime (`pleat-rt`); and `pleat run`'s loading of the
//! shared libraries it writes, with the path each rank takes ([`ExecutionPath`]).
//!
//! Without the `llvm` feature, `--emit` is refused with an error that says so; loading libraries
//! that a build with the feature wrote needs no LLVM.

use std::path::{Path, PathBuf};

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
    /// A rank executable (`rank<i>`, no extension): the rank's object linked with the static runtime
    /// `libpleat_rt.a` and MPI; `pleat run DIR` starts one process a rank with mpirun.
    Exe,
    /// PTX for sm_80 and sm_90 (`.sm_80.ptx`, `.sm_90.ptx`).
    Ptx,
}

/// Refuses `--emit` when pleat was built without LLVM, and `--emit exe` when the static runtime
/// cannot be found, before any work is done.
pub fn check_available(emit: &[Emit]) -> Result<()> {
    if !emit.is_empty() && !cfg!(feature = "llvm") {
        anyhow::bail!(crate::usage::UsageError::NativeUnavailable);
    }
    if emit.contains(&Emit::Exe) {
        runtime_library()?;
    }
    Ok(())
}

/// Reorders each program so that residual adds fuse with the RMSNorm after them (a weight's load
/// moves before the add); returns the loads moved.
pub fn schedule(programs: &mut [Program]) -> usize {
    programs.iter_mut().map(pleat_backend::native::schedule_for_fusion).sum()
}

/// The environment variable that names the static runtime `--emit exe` links with.
pub const RUNTIME_LIBRARY_ENV: &str = "PLEAT_RUNTIME_LIB";

/// The static runtime (`libpleat_rt.a`, package `pleat-rt`) that `--emit exe` links each rank with:
/// `$PLEAT_RUNTIME_LIB`, else the newest of the file beside this executable (where `cargo build -p
/// pleat-rt` puts it) and those in that directory's `deps/` (where `cargo test --workspace` builds
/// it), so that an old build never shadows a fresh one.
pub fn runtime_library() -> Result<PathBuf> {
    if let Some(path) = std::env::var_os(RUNTIME_LIBRARY_ENV) {
        let path = PathBuf::from(path);
        if path.is_file() {
            return Ok(path);
        }
        anyhow::bail!(crate::usage::UsageError::RuntimeLibraryNotFound {
            searched: format!("{} (${RUNTIME_LIBRARY_ENV})", path.display())
        });
    }
    let exe = std::env::current_exe()?;
    let beside = exe.parent().unwrap_or(Path::new(".")).to_path_buf();
    let named = beside.join("libpleat_rt.a");
    let deps = beside.join("deps");
    let in_deps = std::fs::read_dir(&deps).into_iter().flatten().flatten().map(|entry| entry.path()).filter(|path| {
        let name = path.file_name().unwrap_or_default().to_string_lossy();
        name.starts_with("libpleat_rt-") && name.ends_with(".a")
    });
    let newest = std::iter::once(named.clone())
        .chain(in_deps)
        .filter_map(|path| Some((std::fs::metadata(&path).ok()?.modified().ok()?, path)))
        .max();
    newest.map(|(_, path)| path).ok_or_else(|| {
        crate::usage::UsageError::RuntimeLibraryNotFound {
            searched: format!("{} or {}/libpleat_rt-*.a", named.display(), deps.display()),
        }
        .into()
    })
}

/// Writes every `emit` artifact for every program into `dir`; returns the file names written.
#[cfg(feature = "llvm")]
pub fn emit(programs: &[Program], emit: &[Emit], target_cpu: Option<&str>, dir: &Path) -> Result<Vec<String>> {
    use pleat_backend::llvm::{Artifact, CodegenOptions};
    let runtime_library = emit.contains(&Emit::Exe).then(runtime_library).transpose()?;
    let options = CodegenOptions { target_cpu: target_cpu.map(str::to_string), runtime_library };
    let mut written = Vec::new();
    // `--emit so --emit so` builds the libraries once.
    let mut kinds: Vec<Emit> = Vec::new();
    for &kind in emit {
        if !kinds.contains(&kind) {
            kinds.push(kind);
        }
    }
    for kind in kinds {
        let artifact = match kind {
            Emit::LlvmIr => Artifact::LlvmIr,
            Emit::Asm => Artifact::Asm,
            Emit::Obj => Artifact::Object,
            Emit::So => Artifact::SharedLibrary,
            Emit::Exe => Artifact::Executable,
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

/// Refuses a `--target-cpu` LLVM cannot generate code for, before anything is compiled or
/// written (LLVM itself would abort the process halfway through emitting).
#[cfg(feature = "llvm")]
pub fn check_target_cpu(target_cpu: Option<&str>) -> Result<()> {
    Ok(target_cpu.map(pleat_backend::llvm::check_host_target_cpu).transpose().map(drop)?)
}

/// Without LLVM nothing is emitted (`check_available` refuses any `--emit`).
#[cfg(not(feature = "llvm"))]
pub fn check_target_cpu(_target_cpu: Option<&str>) -> Result<()> {
    Ok(())
}

/// Without LLVM: `check_available` has already refused any `--emit`.
#[cfg(not(feature = "llvm"))]
pub fn emit(_programs: &[Program], emit: &[Emit], _target_cpu: Option<&str>, _dir: &Path) -> Result<Vec<String>> {
    check_available(emit)?;
    Ok(Vec::new())
}

/// Generates every program's shared library (each first reordered so that adds fuse with their
/// norms) into a scratch directory and loads them: `--native`. The scratch directory is removed
/// once the libraries are loaded (a loaded library needs no file).
#[cfg(feature = "llvm")]
pub fn build_and_load(programs: &mut [Program]) -> Result<Vec<Option<NativeKernels>>> {
    schedule(programs);
    let scratch = crate::scratch::ScratchDir::new("native")?;
    emit(programs, &[Emit::So], None, scratch.path())?;
    load(scratch.path(), programs)
}

/// Without LLVM, `--native` is refused.
#[cfg(not(feature = "llvm"))]
pub fn build_and_load(_programs: &mut [Program]) -> Result<Vec<Option<NativeKernels>>> {
    anyhow::bail!(crate::usage::UsageError::NativeUnavailable)
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
    /// The rank's executable (`DIR/rank<i>`) ran the program as an MPI process through its entry
    /// function, calling the static runtime's C ABI.
    NativeExecutable,
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
            ExecutionPath::NativeExecutable => "native-executable",
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
