//! `pleat bench calibrate` (or `pleat bench --calibrate`): measures what one rank reaches here
//! (GEMM FLOP/s, streaming bandwidth, the threads communicator's bandwidth and latency; see
//! `pleat_runtime::calibrate`) and writes it as a hardware spec that `pleat plan --hw-file`,
//! `compare` and `trace` read, so that predictions are made for this machine rather than from the
//! nominal `cpu` entry. `pleat bench` alone prints the figures.

use std::path::PathBuf;

use anyhow::Result;
use clap::Args;
use pleat_passes::cost::hw::{Efficiency, HardwareSpec, LinkSpec};
use pleat_runtime::calibrate::{calibrate, Calibration, CalibrationOptions, MEASUREMENTS};

use crate::progress::Progress;

/// Arguments of `pleat bench calibrate`.
#[derive(Args)]
pub struct CalibrateArgs {
    /// Where to write the spec (JSON); without it, it is printed.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Small sizes: seconds less, figures that only bound the full ones from below.
    #[arg(long)]
    pub quick: bool,
}

/// Runs `pleat bench calibrate` (and `pleat bench --calibrate`).
pub fn run_calibrate(args: &CalibrateArgs) -> Result<()> {
    if let Some(path) = &args.out {
        crate::checkpoint::check_output_file(path, "--out")?;
    }
    let calibration = measure(args.quick)?;
    let spec = spec_of(&calibration, crate::host_memory::total_bytes()?).validate()?;
    let json = serde_json::to_string_pretty(&spec)?;
    eprintln!(
        "one rank here: {:.1} GFLOP/s f32 GEMM, {:.1} GFLOP/s attention, {:.1} GB/s streaming, {:.1} GB/s row-wise, link {:.2} GB/s and {:.1} µs, {} cores",
        calibration.gemm_flops_per_s / 1e9,
        calibration.attention_flops_per_s / 1e9,
        calibration.stream_bytes_per_s / 1e9,
        calibration.row_kernel_bytes_per_s / 1e9,
        calibration.link_bytes_per_s / 1e9,
        calibration.link_latency_s * 1e6,
        calibration.cores
    );
    match &args.out {
        Some(path) => {
            crate::checkpoint::write_file_atomically(path, (json + "\n").as_bytes())?;
            println!("wrote {}; use it with --hw-file {}", path.display(), path.display());
        }
        None => println!("{json}"),
    }
    Ok(())
}

/// Runs `pleat bench` alone: the figures, one a line, for a person to read.
pub fn print_figures(quick: bool) -> Result<()> {
    let calibration = measure(quick)?;
    println!("one rank of this machine ({} cores):", calibration.cores);
    for (what, figure) in [
        ("f32 GEMM", format!("{:.1} GFLOP/s", calibration.gemm_flops_per_s / 1e9)),
        ("attention", format!("{:.1} GFLOP/s", calibration.attention_flops_per_s / 1e9)),
        ("streaming", format!("{:.1} GB/s", calibration.stream_bytes_per_s / 1e9)),
        ("row-wise (RMSNorm)", format!("{:.1} GB/s", calibration.row_kernel_bytes_per_s / 1e9)),
        ("link bandwidth", format!("{:.2} GB/s", calibration.link_bytes_per_s / 1e9)),
        ("link latency", format!("{:.1} µs one way", calibration.link_latency_s * 1e6)),
    ] {
        println!("  {what:<20} {figure}");
    }
    println!("write them as a hardware spec for --hw-file: pleat bench --calibrate --out here.json");
    Ok(())
}

/// Measures this machine, with a bar on a terminal.
fn measure(quick: bool) -> Result<Calibration> {
    let options = if quick { CalibrationOptions::quick() } else { CalibrationOptions::full() };
    let progress = Progress::new("calibrating", "measurement", MEASUREMENTS, true);
    let calibration = calibrate(&options, &mut |done| progress.set(done));
    progress.finish();
    Ok(calibration?)
}

/// The spec of a calibrated machine: measured rates as the peaks, with efficiency 1 for what was
/// measured (the measurement already is what the kernels reach).
fn spec_of(calibration: &Calibration, memory_bytes: u64) -> HardwareSpec {
    let link = LinkSpec { bandwidth_bytes_per_s: calibration.link_bytes_per_s, latency_s: calibration.link_latency_s };
    HardwareSpec {
        name: "cpu-calibrated".into(),
        memory_bytes,
        // The CPU runtime computes in f32 whatever the declared dtype.
        peak_bf16_flops: calibration.gemm_flops_per_s,
        peak_f32_flops: calibration.gemm_flops_per_s,
        hbm_bytes_per_s: calibration.stream_bytes_per_s,
        intra_node: link,
        inter_node: link,
        // Ranks as threads all sit in this one process: one node, however many cores it has (the
        // built-in `cpu` entry's figure), so that no group is costed as crossing nodes.
        gpus_per_node: 1024,
        efficiency: Efficiency {
            matmul: 1.0,
            // Attention and row-wise kernels reach less than the GEMM and the streaming add: the
            // measured ratios, so that the roofline of each class is what its kernel runs at.
            attention: (calibration.attention_flops_per_s / calibration.gemm_flops_per_s).min(1.0),
            memory_bound: (calibration.row_kernel_bytes_per_s / calibration.stream_bytes_per_s).min(1.0),
            link: 1.0,
        },
    }
}
