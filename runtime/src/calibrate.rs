//! Calibration: what this machine's ranks actually reach, measured with the runtime's own kernels
//! and communicator, for the cost model to predict this machine instead of a datasheet.
//!
//! Every figure is per rank, and a rank is one thread (ranks run as threads, one GEMM thread each;
//! see [`crate::launch`]); the kernels run on every core at once, as a run's ranks do, and a
//! figure is the slowest core's: the f32 GEMM rate of `matmul_nt` on one thread, the streaming bandwidth of
//! an elementwise add on one thread (bytes read and written), the rates the attention kernel and a
//! row-wise kernel (RMSNorm over rows of a transformer's width) reach on one thread, counted as the
//! cost model counts them (`4·b·sq·sk·h·d` FLOPs; bytes read and written), and the threads
//! communicator's point-to-point bandwidth and latency between two ranks. Each figure is the best of several
//! repeats, which is the usual way to measure a peak on a shared machine: noise only ever slows a
//! run down.

use std::time::{Duration, Instant};

use crate::comm::{CommError, Communicator, ThreadFabric};
use crate::kernels;

/// How big and how often to measure.
#[derive(Clone, Copy, Debug)]
pub struct CalibrationOptions {
    /// The GEMM's m = n = k.
    pub gemm_size: usize,
    /// Elements of each operand of the streaming add.
    pub stream_elements: usize,
    /// Elements of the bandwidth message.
    pub message_elements: usize,
    /// Runs of each measurement; the fastest counts.
    pub repeats: usize,
}

impl CalibrationOptions {
    /// Sizes large enough that fixed costs vanish (a second or two on one core).
    pub fn full() -> Self {
        CalibrationOptions { gemm_size: 1024, stream_elements: 1 << 24, message_elements: 1 << 24, repeats: 5 }
    }

    /// Small sizes, for a smoke run: figures are lower bounds of the full ones.
    pub fn quick() -> Self {
        CalibrationOptions { gemm_size: 256, stream_elements: 1 << 20, message_elements: 1 << 20, repeats: 2 }
    }
}

/// What one rank of this machine reaches.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Calibration {
    /// f32 GEMM FLOP/s on one thread.
    pub gemm_flops_per_s: f64,
    /// Bytes a second an elementwise kernel streams (two reads and a write an element).
    pub stream_bytes_per_s: f64,
    /// Attention FLOP/s on one thread (causal, FLOPs counted as if every key were seen).
    pub attention_flops_per_s: f64,
    /// Bytes a second RMSNorm over rows of 128 reads and writes on one thread.
    pub row_kernel_bytes_per_s: f64,
    /// Bytes a second one rank sends to another over the threads communicator.
    pub link_bytes_per_s: f64,
    /// Seconds of a one-element message's one-way trip.
    pub link_latency_s: f64,
    /// Cores this machine offers (how many ranks can run at once).
    pub cores: usize,
}

fn fastest(repeats: usize, mut run: impl FnMut() -> Result<Duration, CommError>) -> Result<Duration, CommError> {
    let mut best = Duration::MAX;
    for _ in 0..repeats.max(1) {
        best = best.min(run()?);
    }
    // A clock too coarse for the work would divide by zero below.
    Ok(best.max(Duration::from_nanos(1)))
}

/// The slowest of `cores` threads each running `work` at once (each times its own kernel, so that
/// setting up its buffers is not counted), the fastest of `repeats` tries: what a rank reaches
/// while every core runs a rank, as a run's ranks do.
fn on_every_core(cores: usize, repeats: usize, work: impl Fn() -> Duration + Sync) -> Duration {
    let mut best = Duration::MAX;
    for _ in 0..repeats.max(1) {
        let slowest = std::thread::scope(|scope| {
            let threads: Vec<_> = (0..cores.max(1)).map(|_| scope.spawn(&work)).collect();
            threads.into_iter().map(|thread| thread.join().unwrap_or(Duration::MAX)).max().unwrap_or(Duration::ZERO)
        });
        best = best.min(slowest);
    }
    best.max(Duration::from_nanos(1))
}

/// How many measurements [`calibrate`] makes, one after another.
pub const MEASUREMENTS: u64 = 6;

/// Measures this machine, calling `measured` with the count done after each of its
/// [`MEASUREMENTS`] (for a progress bar). Errors only if the threads communicator fails.
pub fn calibrate(options: &CalibrationOptions, measured: &mut dyn FnMut(u64)) -> Result<Calibration, CommError> {
    let size = options.gemm_size;
    let a: Vec<f32> = (0..size * size).map(|i| (i % 7) as f32 * 0.25).collect();
    let b: Vec<f32> = (0..size * size).map(|i| (i % 5) as f32 * 0.5).collect();
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    let gemm = on_every_core(cores, options.repeats, || {
        let mut c = vec![0.0f32; size * size];
        let start = Instant::now();
        kernels::matmul_nt(size, size, size, &a, &b, &mut c, false, 1);
        start.elapsed()
    });
    let gemm_flops_per_s = 2.0 * (size as f64).powi(3) / gemm.as_secs_f64();
    measured(1);

    let x = vec![1.0f32; options.stream_elements];
    let y = vec![2.0f32; options.stream_elements];
    let mut sum = vec![0.0f32; options.stream_elements];
    let stream = fastest(options.repeats, || {
        let start = Instant::now();
        kernels::add(&x, &y, &mut sum);
        Ok(start.elapsed())
    })?;
    let stream_bytes_per_s = 3.0 * 4.0 * options.stream_elements as f64 / stream.as_secs_f64();
    measured(2);

    // Attention of a small transformer's shape: 4 sequences of 128, 4 heads of 32.
    let shape = kernels::AttentionShape { causal: true, ..kernels::AttentionShape::new(4, 128, 128, 4, 4, 32) };
    let (q, k, v) = (vec![0.1f32; 4 * 128 * 4 * 32], vec![0.2f32; 4 * 128 * 4 * 32], vec![0.3f32; 4 * 128 * 4 * 32]);
    let positions: Vec<u32> = (0..128).collect();
    let attention = on_every_core(cores, options.repeats, || {
        let mut attended = vec![0.0f32; q.len()];
        let start = Instant::now();
        kernels::attention(&shape, &q, &k, &v, &positions, &positions, &mut attended)
            .expect("the calibration's attention shape is valid");
        start.elapsed()
    });
    let attention_flops_per_s = 4.0 * 4.0 * 128.0 * 128.0 * 4.0 * 32.0 / attention.as_secs_f64();
    measured(3);

    let hidden = 128;
    let rows = (options.stream_elements / hidden).max(1);
    let weight = vec![1.0f32; hidden];
    let row_kernel = on_every_core(cores, options.repeats, || {
        // Written before the clock starts (a zeroed allocation is only mapped on first write), so
        // the kernel is timed and not the page faults of a fresh buffer; a run's buffers are
        // reused memory, as the add's result above is.
        let mut normed = vec![1.0f32; rows * hidden];
        let start = Instant::now();
        kernels::rms_norm(&x[..rows * hidden], &weight, &mut normed, hidden, 1e-5);
        start.elapsed()
    });
    let row_kernel_bytes_per_s = 2.0 * 4.0 * (rows * hidden) as f64 / row_kernel.as_secs_f64();
    measured(4);

    let message = vec![0.5f32; options.message_elements];
    let bandwidth = fastest(options.repeats, || one_way(&message))?;
    let link_bytes_per_s = 4.0 * options.message_elements as f64 / bandwidth.as_secs_f64();
    measured(5);
    let latency = fastest(options.repeats.max(10), || one_way(&[0.0]))?;
    measured(MEASUREMENTS);

    Ok(Calibration {
        gemm_flops_per_s,
        stream_bytes_per_s,
        attention_flops_per_s,
        row_kernel_bytes_per_s,
        link_bytes_per_s,
        link_latency_s: latency.as_secs_f64(),
        cores,
    })
}

/// Half a round trip of `data` between two ranks (there and back, so that both clocks are one).
fn one_way(data: &[f32]) -> Result<Duration, CommError> {
    let mut comms = ThreadFabric::new(2, Duration::from_secs(60));
    let mut echo = comms.pop().expect("two endpoints");
    let mut origin = comms.pop().expect("two endpoints");
    std::thread::scope(|scope| {
        let echoer = scope.spawn(move || {
            let mut buf = vec![0.0f32; data.len()];
            echo.recv(0, &mut buf)?;
            echo.send(0, &buf)
        });
        let mut back = vec![0.0f32; data.len()];
        let start = Instant::now();
        origin.send(1, data)?;
        origin.recv(1, &mut back)?;
        let elapsed = start.elapsed();
        echoer.join().unwrap_or_else(|payload| std::panic::resume_unwind(payload))?;
        Ok(elapsed / 2)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quick_calibration_gives_positive_finite_figures() {
        let options = CalibrationOptions { gemm_size: 64, stream_elements: 4096, message_elements: 4096, repeats: 1 };
        let mut counts = Vec::new();
        let calibration = calibrate(&options, &mut |done| counts.push(done)).expect("the threads communicator works");
        assert_eq!(counts, (1..=MEASUREMENTS).collect::<Vec<_>>(), "one call a measurement, in order");
        for (name, value) in [
            ("gemm", calibration.gemm_flops_per_s),
            ("stream", calibration.stream_bytes_per_s),
            ("attention", calibration.attention_flops_per_s),
            ("row kernel", calibration.row_kernel_bytes_per_s),
            ("link", calibration.link_bytes_per_s),
        ] {
            assert!(value.is_finite() && value > 0.0, "{name}: {value}");
        }
        assert!(calibration.link_latency_s.is_finite() && calibration.link_latency_s > 0.0);
        assert!(calibration.cores >= 1);
    }
}
