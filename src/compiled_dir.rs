//! A compiled directory, as `pleat compile` writes it and `pleat run DIR` reads it back:
//! `plan.json`, `config.json`, `module.pleat`, each rank's `rank<i>.program` (and `rank<i>.txt`),
//! and a training step's `rank<i>.optimizer.json`, all under one fingerprint; and the `--emit`
//! artifacts (`rank<i>.so`, the rank executables, ...), each under its own hash, checked before
//! one is loaded or started (a truncated library would crash the loader).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use pleat_backend::optimizer::OptimizerLayout;
use pleat_backend::Program;
use pleat_ir::model::config::ModelConfig;
use pleat_ir::Module;
use serde::{Deserialize, Serialize};

use crate::train::TrainingPlan;
use crate::usage::UsageError;

/// The version of `plan.json`: 2 hashes `config.json` with the plan and records the native
/// artifacts' hashes.
pub const PLAN_FORMAT_VERSION: u32 = 2;

/// `plan.json`: what a compiled directory holds, for `pleat run DIR`.
#[derive(Serialize, Deserialize)]
pub struct PlanFile {
    /// `PLAN_FORMAT_VERSION`.
    pub format_version: u32,
    /// The model's name.
    pub model: String,
    /// The mesh.
    pub mesh: String,
    /// The `--strategy` it was compiled with.
    pub strategy: String,
    /// Ranks (one `rank<i>.program` each).
    pub ranks: u32,
    /// Sequences a batch.
    pub batch: u64,
    /// Sequence length.
    pub seq: u64,
    /// `program format` of the rank files.
    pub program_format_version: u32,
    /// The plan's fingerprint: `config.json`, the sharded module's text, every rank's program, a
    /// training step's optimizer layouts and this file's fields that say how they run
    /// (`write_compiled`); reading the directory checks it.
    pub plan_hash: String,
    /// A training step's plan (`--train`), whose ranks' optimizer layouts are
    /// `rank<i>.optimizer.json`; absent for a forward pass.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub training: Option<TrainingPlan>,
    /// The weights beside the model it was compiled from (a model directory's safetensors or
    /// checkpoint, as an absolute path), which `pleat run DIR` loads as `pleat run MODEL` would;
    /// absent for a config or preset without weights (seeded synthetic weights).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weights: Option<PathBuf>,
    /// Each `--emit` artifact's file name and FNV-1a hash: what `pleat compile` wrote, checked
    /// ([`check_native_files`]) before a library is loaded or an executable started.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub native_files: BTreeMap<String, String>,
}

/// What `write_compiled` writes: a sharded module, its ranks' programs, and what `plan.json`
/// says of them.
pub(crate) struct CompiledFiles<'a> {
    pub config: &'a ModelConfig,
    pub module: &'a Module,
    pub programs: &'a [Program],
    /// The whole mesh (a training step's module holds the mesh within a pipeline stage).
    pub mesh: String,
    pub batch: u64,
    pub seq: u64,
    pub strategy: &'static str,
    /// A training step's plan and each rank's optimizer layout.
    pub training: Option<(&'a TrainingPlan, &'a [OptimizerLayout])>,
    /// The weights beside the model ([`PlanFile::weights`]).
    pub weights: Option<PathBuf>,
}

impl<'a> CompiledFiles<'a> {
    /// A forward pass's files: `compiled`'s module and programs, for `batch` sequences of `seq`.
    pub fn forward(
        config: &'a ModelConfig,
        compiled: &'a crate::compile::Compiled,
        (batch, seq): (u64, u64),
        strategy: &'static str,
    ) -> CompiledFiles<'a> {
        CompiledFiles {
            config,
            module: &compiled.sharded,
            programs: &compiled.programs,
            mesh: compiled.sharded.mesh.to_string(),
            batch,
            seq,
            strategy,
            training: None,
            weights: None,
        }
    }
}

/// A compiled directory, read back and checked against its fingerprint.
pub struct CompiledDir {
    pub plan: PlanFile,
    pub config: ModelConfig,
    pub programs: Vec<Program>,
    /// Each rank's optimizer layout: a training step's; empty for a forward pass.
    pub layouts: Vec<OptimizerLayout>,
}

impl CompiledDir {
    /// Reads the compiled directory `dir` (`read_compiled`) to run its forward pass: a directory
    /// of training programs is refused.
    pub fn read_forward(dir: &Path) -> Result<CompiledDir> {
        let compiled = read_compiled(dir)?;
        if compiled.plan.training.is_some() {
            anyhow::bail!(UsageError::ForwardOfTrainingDir { dir: dir.to_path_buf() });
        }
        Ok(compiled)
    }

    /// The training plan; refuses a directory of forward programs.
    pub fn expect_training(&self, dir: &Path) -> Result<&TrainingPlan> {
        self.plan.training.as_ref().ok_or_else(|| UsageError::TrainOfForwardDir { dir: dir.to_path_buf() }.into())
    }
}

/// Writes the compiled directory into a temporary sibling, `emit` its native artifacts there too,
/// then renames it into place, so an interrupted or failed compile never leaves a half-written
/// directory (nor one without the code asked for). Returns the plan's fingerprint and the names of
/// the artifacts emitted. The fingerprint is FNV-1a over the bytes of `config.json`,
/// `module.pleat`, every `rank<i>.program` and a training step's `rank<i>.optimizer.json` as
/// written, which `read_compiled` checks: equal plans, byte for byte, have equal hashes.
pub(crate) fn write_compiled(
    out: &Path,
    files: &CompiledFiles,
    emit: impl FnOnce(&Path) -> Result<Vec<String>>,
) -> Result<(String, Vec<String>)> {
    let config_text = files.config.to_hf_json();
    let module_text = pleat_ir::text::print_module(files.module);
    let program_texts: Vec<String> = files.programs.iter().map(pleat_backend::to_json).collect();
    let layout_texts: Vec<String> = match files.training {
        Some((_, layouts)) => layouts.iter().map(serde_json::to_string_pretty).collect::<Result<_, _>>()?,
        None => Vec::new(),
    };
    let mut plan = PlanFile {
        format_version: PLAN_FORMAT_VERSION,
        model: files.config.name.clone(),
        mesh: files.mesh.clone(),
        strategy: files.strategy.to_string(),
        ranks: files.programs.len() as u32,
        batch: files.batch,
        seq: files.seq,
        program_format_version: pleat_backend::FORMAT_VERSION,
        plan_hash: String::new(),
        training: files.training.map(|(training, _)| training.clone()),
        weights: files.weights.clone(),
        native_files: BTreeMap::new(),
    };
    let mut fingerprint = crate::fingerprint::Fingerprint::new();
    fingerprint.part(config_text.as_bytes()).part(module_text.as_bytes());
    for text in program_texts.iter().chain(&layout_texts) {
        fingerprint.part(text.as_bytes());
    }
    fingerprint.part(plan_fields(&plan)?.as_bytes());
    let plan_hash = fingerprint.hex();
    plan.plan_hash.clone_from(&plan_hash);
    let mut emitted = Vec::new();
    crate::checkpoint::write_dir_atomically(out, "plan.json", |staging| {
        emitted = emit(staging)?;
        for name in &emitted {
            plan.native_files.insert(name.clone(), file_hash(&staging.join(name))?);
        }
        std::fs::write(staging.join("plan.json"), serde_json::to_string_pretty(&plan)?)?;
        std::fs::write(staging.join("config.json"), &config_text)?;
        std::fs::write(staging.join("module.pleat"), module_text)?;
        for (program, text) in files.programs.iter().zip(program_texts) {
            std::fs::write(staging.join(format!("rank{}.program", program.rank)), text)?;
            std::fs::write(
                staging.join(format!("rank{}.txt", program.rank)),
                pleat_backend::text::print_program(program),
            )?;
        }
        for (rank, text) in layout_texts.iter().enumerate() {
            std::fs::write(staging.join(format!("rank{rank}.optimizer.json")), text)?;
        }
        Ok(())
    })?;
    Ok((plan_hash, emitted))
}

/// Refuses `--no-overlap` or `--comm-streams 1` where a compiled directory's `programs` were
/// scheduled otherwise: they run (and are traced) as compiled. A directory compiled with the same
/// flag passes.
pub fn check_schedule_flags(no_overlap: bool, comm_streams: u8, programs: &[Program]) -> Result<()> {
    let instructions = || programs.iter().flat_map(|program| &program.instructions);
    if no_overlap && instructions().any(|instr| matches!(instr, pleat_backend::Instr::Wait { .. })) {
        bail!(UsageError::DiffersFromPlan {
            flag: "--no-overlap",
            given: "(every transfer blocking)".to_string(),
            planned: "scheduled transfers; compile with --no-overlap for blocking ones".to_string(),
        });
    }
    let prefetches = instructions().any(|instr| instr.transfer_stream() == pleat_backend::TransferStream::Prefetch);
    if comm_streams == 1 && prefetches {
        bail!(UsageError::DiffersFromPlan {
            flag: "--comm-streams",
            given: "1".to_string(),
            planned: "2 (weight prefetches on a stream of their own); compile with --comm-streams 1".to_string(),
        });
    }
    Ok(())
}

/// The fields of `plan.json` that say how the programs run (an edited `training.zero` trained as
/// "zero 1" programs compiled for none), as the fingerprint reads them. The weights' path is left
/// out: moved weights are E0754's, and `--weights` overrides it anyway.
fn plan_fields(plan: &PlanFile) -> Result<String> {
    Ok(serde_json::to_string(&serde_json::json!({
        "model": plan.model,
        "mesh": plan.mesh,
        "strategy": plan.strategy,
        "ranks": plan.ranks,
        "batch": plan.batch,
        "seq": plan.seq,
        "program_format_version": plan.program_format_version,
        "training": plan.training,
    }))?)
}

/// The FNV-1a hash of the file at `path`, as 16 hex digits.
fn file_hash(path: &Path) -> Result<String> {
    let bytes = std::fs::read(path).with_context(|| format!("cannot read {}", path.display()))?;
    Ok(crate::fingerprint::Fingerprint::new().part(&bytes).hex())
}

/// Checks that every native artifact of `dir` that pleat would load or start (`rank<i>.so`,
/// `rank<i>`, `rank<i>.<sm>.cuda.json`) is the one `pleat compile` wrote: a library truncated or
/// overwritten after it would crash the loader or run other code. (The artifacts written for
/// people to read, `.ll`, `.s`, `.o` and `.ptx`, are not run; one removed is not run either, and
/// what a run needs and lacks, it reports itself.)
fn check_native_files(dir: &Path, plan: &PlanFile) -> Result<()> {
    let is_rank = |stem: &str| stem.strip_prefix("rank").is_some_and(|index| index.parse::<u32>().is_ok());
    let loadable = std::fs::read_dir(dir)
        .with_context(|| format!("cannot list {}", dir.display()))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| {
            let stem = name.split('.').next().unwrap_or_default();
            is_rank(stem) && (name == stem || name.ends_with(".so") || name.ends_with(".cuda.json"))
        });
    for name in loadable {
        let path = dir.join(&name);
        let recorded = plan.native_files.get(&name);
        let actual = file_hash(&path)
            .map_err(|error| UsageError::CompiledFileUnreadable { path: path.clone(), reason: format!("{error:#}") })?;
        if recorded != Some(&actual) {
            bail!(UsageError::NativeFileChanged { path, recorded: recorded.cloned(), actual });
        }
    }
    Ok(())
}

/// Reads a compiled directory back: its plan, config, programs and (a training step's) optimizer
/// layouts.
pub fn read_compiled(dir: &Path) -> Result<CompiledDir> {
    let plan_path = dir.join("plan.json");
    let plan: PlanFile = serde_json::from_str(
        &crate::text_file::read_text(&plan_path).with_context(|| format!("cannot read {}", plan_path.display()))?,
    )
    .map_err(|error| UsageError::NotAPlan { path: plan_path.clone(), what: "plan", reason: error.to_string() })?;
    if plan.format_version != PLAN_FORMAT_VERSION {
        anyhow::bail!(UsageError::PlanFormatVersion {
            path: plan_path,
            found: plan.format_version,
            expected: PLAN_FORMAT_VERSION
        });
    }
    // The hash covers the files as written (`write_compiled`): a damaged or edited directory is
    // refused before anything runs.
    let mut fingerprint = crate::fingerprint::Fingerprint::new();
    let read = |name: String, fingerprint: &mut crate::fingerprint::Fingerprint| -> Result<(PathBuf, String)> {
        let path = dir.join(name);
        let text = std::fs::read_to_string(&path)
            .map_err(|error| UsageError::CompiledFileUnreadable { path: path.clone(), reason: error.to_string() })?;
        fingerprint.part(text.as_bytes());
        Ok((path, text))
    };
    let (config_path, config_text) = read("config.json".into(), &mut fingerprint)?;
    read("module.pleat".into(), &mut fingerprint)?;
    let programs = (0..plan.ranks)
        .map(|rank| {
            let (path, text) = read(format!("rank{rank}.program"), &mut fingerprint)?;
            pleat_backend::from_json(&text).with_context(|| format!("{}", path.display()))
        })
        .collect::<Result<Vec<_>>>()?;
    let layouts = match plan.training {
        Some(_) => (0..plan.ranks)
            .map(|rank| {
                let (path, text) = read(format!("rank{rank}.optimizer.json"), &mut fingerprint)?;
                serde_json::from_str(&text).map_err(|error| {
                    UsageError::NotAPlan { path, what: "optimizer layout", reason: error.to_string() }.into()
                })
            })
            .collect::<Result<Vec<OptimizerLayout>>>()?,
        None => Vec::new(),
    };
    fingerprint.part(plan_fields(&plan)?.as_bytes());
    if fingerprint.hex() != plan.plan_hash {
        anyhow::bail!(UsageError::PlanHashMismatch {
            path: plan_path,
            recorded: plan.plan_hash,
            actual: fingerprint.hex()
        });
    }
    check_native_files(dir, &plan)?;
    // Parsed once its bytes are known to be those compiled (from the text the hash read).
    let config = ModelConfig::from_json_str(&config_text, &config_path.display().to_string())?;
    Ok(CompiledDir { plan, config, programs, layouts })
}

/// The weights a run of the compiled directory `dir` loads: `given` (`--weights`), else those
/// `plan` recorded, which must still be there: a directory compiled from a model directory runs on
/// its weights, never silently on seeded ones.
pub fn weights_for(given: Option<&Path>, dir: &Path, plan: &PlanFile) -> Result<Option<PathBuf>> {
    match (given, &plan.weights) {
        (Some(given), _) => Ok(Some(given.to_path_buf())),
        (None, Some(recorded)) if !recorded.exists() => {
            bail!(UsageError::CompiledWeightsGone { dir: dir.to_path_buf(), weights: recorded.clone() })
        }
        (None, recorded) => Ok(recorded.clone()),
    }
}
