//! `pleat run --device`: where the ranks run. `cpu` is the threads runtime; `cuda` runs every rank
//! on the first NVIDIA GPU (feature `cuda`, `pleat_runtime::cuda`), all ranks of a mesh sharing it.

use std::collections::BTreeMap;

use anyhow::Result;
use clap::ValueEnum;
use pleat_backend::Program;
use pleat_runtime::weights::WeightSource;
use pleat_runtime::{RankOutcome, ThreadRunOptions};

use crate::inputs::Tokens;

/// The largest absolute logit difference from the reference `--check` accepts on a GPU, in f32: the
/// generated kernels use the GPU's approximate `ex2`, `sin` and `cos` (relative errors near 2^-22
/// and 2^-21) and cuBLAS sums in its own order, so the logits agree with the reference to about
/// 1e-5 on `tiny` instead of the CPU runtime's 1e-6; ten times the CPU's tolerance leaves room.
pub const CUDA_F32_TOL: f32 = 1e-3;

/// `--device`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, ValueEnum)]
pub enum Device {
    /// The CPU: every rank a thread of this process.
    #[default]
    Cpu,
    /// The first CUDA device, shared by every rank (needs a build with `--features cuda`).
    Cuda,
}

/// What a run on a GPU says beyond a CPU run's outcomes.
#[derive(Clone, Debug, PartialEq)]
pub struct DeviceReport {
    /// The device, e.g. `device 0: NVIDIA H200 (sm_90, 139.8 GiB)`.
    pub device: String,
    /// Instructions each rank ran on the GPU.
    pub on_device: Vec<usize>,
    /// Instructions each rank ran on the host, by kind.
    pub on_host: Vec<BTreeMap<String, usize>>,
    /// Each rank's time in its instructions other than loads, outputs and frees: the step's work
    /// once weights are resident (each instruction's span ends with the device synchronized).
    pub compute_seconds: Vec<f64>,
    /// Each rank's GEMM FLOPs (2·m·n·k each) over their time: the achieved GEMM FLOP/s.
    pub gemm_flops_per_second: Vec<f64>,
}

impl DeviceReport {
    /// The report of `programs`' run on `device`: each rank's instructions on the GPU, on the
    /// host by kind, and its measured spans.
    #[cfg(feature = "cuda")]
    fn of<'a>(
        device: &pleat_runtime::cuda::CudaDevice,
        programs: &[Program],
        ranks: impl Iterator<Item = (usize, &'a BTreeMap<String, usize>, &'a [(u64, u64)])>,
    ) -> DeviceReport {
        let mut report = DeviceReport {
            device: device.describe(),
            on_device: Vec::new(),
            on_host: Vec::new(),
            compute_seconds: Vec::new(),
            gemm_flops_per_second: Vec::new(),
        };
        for (program, (on_device, on_host, timings)) in programs.iter().zip(ranks) {
            let (seconds, rate) = compute_figures(program, timings);
            report.on_device.push(on_device);
            report.on_host.push(on_host.clone());
            report.compute_seconds.push(seconds);
            report.gemm_flops_per_second.push(rate);
        }
        report
    }

    /// The report as `--format json` prints it.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "name": self.device,
            "on_device_per_rank": self.on_device,
            "on_host_per_rank": self.on_host,
            "compute_seconds_per_rank": self.compute_seconds,
            "gemm_flops_per_second_per_rank": self.gemm_flops_per_second,
        })
    }
}

/// What a run on the GPU gives back.
pub struct CudaRun {
    /// The logits' shape.
    pub logits_shape: Vec<u64>,
    /// The logits, assembled from the ranks' blocks.
    pub logits: Vec<f32>,
    /// Each rank's outcome.
    pub outcomes: Vec<RankOutcome>,
    /// The device and where the instructions ran.
    pub report: DeviceReport,
}

/// A rank's seconds in compute (every instruction but loads, outputs and frees), and its GEMMs'
/// FLOPs over their seconds, from its measured instruction spans (`RankOutcome::timings`).
#[cfg_attr(not(feature = "cuda"), allow(dead_code, reason = "what a run on the GPU reports"))]
pub fn compute_figures(program: &Program, timings: &[(u64, u64)]) -> (f64, f64) {
    use pleat_backend::{Instr, Kernel};
    let (mut compute_ns, mut gemm_ns, mut gemm_flops) = (0u64, 0u64, 0f64);
    for (instr, &(start, end)) in program.instructions.iter().zip(timings) {
        let span = end.saturating_sub(start);
        match instr {
            Instr::LoadParam { .. }
            | Instr::LoadTokens { .. }
            | Instr::LoadPositions { .. }
            | Instr::Output { .. }
            | Instr::Free { .. } => {}
            Instr::Kernel {
                kernel:
                    Kernel::MatMul { m, n, k } | Kernel::MatMulGradInput { m, n, k } | Kernel::MatMulGradWeight { m, n, k },
                ..
            } => {
                compute_ns += span;
                gemm_ns += span;
                gemm_flops += 2.0 * (*m as f64) * (*n as f64) * (*k as f64);
            }
            _ => compute_ns += span,
        }
    }
    let seconds = |nanos: u64| nanos as f64 * 1e-9;
    let rate = if gemm_ns > 0 { gemm_flops / seconds(gemm_ns) } else { 0.0 };
    (seconds(compute_ns), rate)
}

/// Runs `programs` on the first CUDA device and assembles the logits. Their kernels are a compiled
/// directory's `rank<i>.<arch>.cuda.json` (`pleat compile --emit ptx`) when `compiled` holds one
/// for every rank, else generated for the device here (with the `llvm` feature, the programs first
/// reordered so that residual adds fuse with the norms after them; without it the GEMMs still run on
/// cuBLAS and everything else on the host). The programs run `warmup` times first, their results
/// and times dropped.
#[cfg(feature = "cuda")]
pub fn run_on_cuda(
    programs: &mut [Program],
    compiled: Option<&std::path::Path>,
    tokens: &Tokens,
    weights: &dyn WeightSource,
    options: &ThreadRunOptions,
    warmup: u32,
) -> Result<CudaRun> {
    use pleat_runtime::cuda::{run_on_device, CudaDevice};

    let device = CudaDevice::open(0)?;
    let code = match compiled.map(|dir| read_device_code(dir, programs.len(), device.ptx_arch())).transpose()? {
        Some(Some(code)) => code,
        _ => device_code(programs, device.ptx_arch())?,
    };
    let positions: Vec<u32> = (0..tokens.seq as u32).collect();
    let inputs = pleat_runtime::RunInputs {
        tokens: &tokens.ids,
        positions: &positions,
        weights,
        epoch: std::time::Instant::now(),
    };
    for _ in 0..warmup {
        run_on_device(programs, &inputs, options, &device, &code)?;
    }
    let ranks = run_on_device(programs, &inputs, options, &device, &code)?;
    let report = DeviceReport::of(
        &device,
        programs,
        ranks.iter().map(|rank| (rank.on_device, &rank.on_host, rank.outcome.timings.as_slice())),
    );
    let outcomes: Vec<RankOutcome> = ranks.into_iter().map(|rank| rank.outcome).collect();
    let (logits_shape, logits) = pleat_runtime::assemble(&outcomes, 0).ok_or(crate::usage::UsageError::NoLogits)?;
    Ok(CudaRun { logits_shape, logits, outcomes, report })
}

/// Without the `cuda` feature there is no GPU runtime: `--device cuda` says how to get one.
#[cfg(not(feature = "cuda"))]
pub fn run_on_cuda(
    _programs: &mut [Program],
    _compiled: Option<&std::path::Path>,
    _tokens: &Tokens,
    _weights: &dyn WeightSource,
    _options: &ThreadRunOptions,
    _warmup: u32,
) -> Result<CudaRun> {
    anyhow::bail!(crate::usage::UsageError::CudaUnavailable)
}

/// Training on the first CUDA device: the device opened and each rank's kernels generated once,
/// for every chunk of steps a run trains.
#[cfg(feature = "cuda")]
pub struct CudaTrainer {
    device: pleat_runtime::cuda::CudaDevice,
    code: Vec<Option<pleat_backend::native::DeviceCode>>,
}

/// Without the `cuda` feature there is none (`open` says how to get one).
#[cfg(not(feature = "cuda"))]
pub struct CudaTrainer(std::convert::Infallible);

#[cfg(feature = "cuda")]
impl CudaTrainer {
    /// Opens the first device; `programs`' kernels are the compiled directory's (`pleat compile
    /// --train --emit ptx`) when `compiled` holds them for every rank, else generated for the
    /// device here (see [`run_on_cuda`]).
    pub fn open(programs: &mut [Program], compiled: Option<&std::path::Path>) -> Result<CudaTrainer> {
        let device = pleat_runtime::cuda::CudaDevice::open(0)?;
        let code = match compiled.map(|dir| read_device_code(dir, programs.len(), device.ptx_arch())).transpose()? {
            Some(Some(code)) => code,
            _ => device_code(programs, device.ptx_arch())?,
        };
        Ok(CudaTrainer { device, code })
    }

    /// Trains `programs` on the device as `options` say; returns each rank's training, where the
    /// first step's instructions ran and the last step's times (warm: the first step's include
    /// every kernel's first launch).
    pub fn train(
        &self,
        programs: &[Program],
        layouts: &[pleat_backend::optimizer::OptimizerLayout],
        options: &pleat_runtime::train::TrainOptions,
    ) -> Result<(Vec<pleat_runtime::train::RankTraining>, DeviceReport)> {
        let ranks = pleat_runtime::cuda::train_on_device(programs, layouts, options, &self.device, &self.code)?;
        let report = DeviceReport::of(
            &self.device,
            programs,
            ranks.iter().map(|rank| (rank.on_device, &rank.on_host, rank.training.last_timings.as_slice())),
        );
        Ok((ranks.into_iter().map(|rank| rank.training).collect(), report))
    }
}

#[cfg(not(feature = "cuda"))]
impl CudaTrainer {
    /// Without the `cuda` feature: says to rebuild with it.
    pub fn open(_programs: &mut [Program], _compiled: Option<&std::path::Path>) -> Result<CudaTrainer> {
        anyhow::bail!(crate::usage::UsageError::CudaUnavailable)
    }

    /// Unreachable: there is no trainer to call it on.
    pub fn train(
        &self,
        _programs: &[Program],
        _layouts: &[pleat_backend::optimizer::OptimizerLayout],
        _options: &pleat_runtime::train::TrainOptions,
    ) -> Result<(Vec<pleat_runtime::train::RankTraining>, DeviceReport)> {
        match self.0 {}
    }
}

/// A compiled directory's kernels for `arch`, one file a rank; `None` when some rank has none.
#[cfg(feature = "cuda")]
fn read_device_code(
    dir: &std::path::Path,
    ranks: usize,
    arch: &str,
) -> Result<Option<Vec<Option<pleat_backend::native::DeviceCode>>>> {
    use anyhow::Context;
    let paths: Vec<_> = (0..ranks).map(|rank| dir.join(format!("rank{rank}.{arch}.cuda.json"))).collect();
    if !paths.iter().all(|path| path.is_file()) {
        return Ok(None);
    }
    let read = |path: &std::path::PathBuf| -> Result<Option<pleat_backend::native::DeviceCode>> {
        let text = crate::text_file::read_text(path).with_context(|| format!("cannot read {}", path.display()))?;
        let code =
            serde_json::from_str(&text).with_context(|| format!("{} is not pleat's device code", path.display()))?;
        Ok(Some(code))
    };
    paths.iter().map(read).collect::<Result<Vec<_>>>().map(Some)
}

/// Each program's kernels as PTX for `arch`, after [`crate::native::schedule`] has let its adds fuse
/// with their norms.
#[cfg(all(feature = "cuda", feature = "llvm"))]
fn device_code(programs: &mut [Program], arch: &str) -> Result<Vec<Option<pleat_backend::native::DeviceCode>>> {
    crate::native::schedule(programs);
    programs.iter().map(|program| Ok(Some(pleat_backend::llvm::device_code(program, arch)?))).collect()
}

/// Without LLVM no kernel is generated: the GEMMs run on cuBLAS, the rest on the host.
#[cfg(all(feature = "cuda", not(feature = "llvm")))]
fn device_code(programs: &mut [Program], _arch: &str) -> Result<Vec<Option<pleat_backend::native::DeviceCode>>> {
    Ok(vec![None; programs.len()])
}

/// `report`'s lines for a run's text output.
pub fn describe(report: &DeviceReport) -> Vec<String> {
    let mut lines = vec![format!("ran on {}", report.device)];
    let counts: Vec<String> = report
        .on_device
        .iter()
        .zip(&report.on_host)
        .map(|(device, host)| format!("{device} on the GPU, {} on the host", host.values().sum::<usize>()))
        .collect();
    lines.push(format!("instructions a rank: {}", counts.join("; ")));
    let times: Vec<String> = report
        .compute_seconds
        .iter()
        .zip(&report.gemm_flops_per_second)
        .map(|(seconds, rate)| format!("{:.3} ms, GEMMs at {:.2} TFLOP/s", seconds * 1e3, rate * 1e-12))
        .collect();
    lines.push(format!("compute a rank (loads excluded): {}", times.join("; ")));
    let mut kinds: BTreeMap<&str, usize> = BTreeMap::new();
    for host in &report.on_host {
        for (kind, count) in host {
            *kinds.entry(kind).or_default() += count;
        }
    }
    if !kinds.is_empty() {
        let kinds: Vec<String> = kinds.iter().map(|(kind, count)| format!("{kind} {count}")).collect();
        lines.push(format!("on the host (all ranks): {}", kinds.join(", ")));
    }
    lines
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compute_figures_leave_out_loads_and_rate_the_gemms_alone() {
        use pleat_backend::{BufferId, Instr, Kernel};
        use pleat_ir::entity::EntityRef;
        let buffer = BufferId::new;
        let program = Program {
            instructions: vec![
                Instr::Free { buf: buffer(0) },
                Instr::Kernel { kernel: Kernel::MatMul { m: 10, n: 20, k: 30 }, inputs: vec![], out: buffer(1) },
                Instr::Kernel { kernel: Kernel::Add, inputs: vec![], out: buffer(2) },
            ],
            format_version: pleat_backend::program::FORMAT_VERSION,
            model: "gemm".into(),
            mesh: String::new(),
            rank: 0,
            world_size: 1,
            tokens_shape: Vec::new(),
            buffers: Vec::new(),
        };
        // The free's 1 s is not compute; the GEMM takes 2 µs and the add 3 µs.
        let timings = [(0, 1_000_000_000), (0, 2_000), (0, 3_000)];
        let (seconds, rate) = compute_figures(&program, &timings);
        assert!((seconds - 5e-6).abs() < 1e-12, "{seconds}");
        // 2·10·20·30 = 12 000 FLOPs in 2 µs.
        assert!((rate - 6e9).abs() < 1.0, "{rate}");
    }

    #[test]
    fn describe_counts_each_ranks_instructions_and_the_host_kinds_over_ranks() {
        let report = DeviceReport {
            device: "device 0: GPU".into(),
            on_device: vec![10, 12],
            on_host: vec![
                BTreeMap::from([("LoadParam".to_string(), 3), ("AllReduce".to_string(), 2)]),
                BTreeMap::from([("LoadParam".to_string(), 3)]),
            ],
            compute_seconds: vec![0.002, 0.0025],
            gemm_flops_per_second: vec![1.5e12, 2e12],
        };
        assert_eq!(
            describe(&report),
            vec![
                "ran on device 0: GPU".to_string(),
                "instructions a rank: 10 on the GPU, 5 on the host; 12 on the GPU, 3 on the host".to_string(),
                "compute a rank (loads excluded): 2.000 ms, GEMMs at 1.50 TFLOP/s; 2.500 ms, GEMMs at 2.00 TFLOP/s"
                    .to_string(),
                "on the host (all ranks): AllReduce 2, LoadParam 6".to_string(),
            ]
        );
    }
}
