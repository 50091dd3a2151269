//! `pleat run --device cuda`: on a machine with an NVIDIA GPU, every layout's logits on the device
//! equal the reference interpreter's within the GPU tolerance (`CUDA_F32_TOL`, 1e-3: approximate
//! `ex2`/`sin`/`cos` and cuBLAS's summation order); without one, the run fails at once with E0607
//! naming what is missing, and each equivalence case prints `skipped: no CUDA device` where the
//! test output shows it. Training on the device (`--train --device cuda`) matches the reference's
//! losses, gradients and weights within the tolerances the run states. Without the `cuda` feature,
//! `--device cuda` says to rebuild with it.

use std::io::Write;

#[path = "support/cli.rs"]
mod cli;

use cli::{error_of, json_of, pleat};

/// The GPU tolerance the binary applies (`device::CUDA_F32_TOL`).
const CUDA_F32_TOL: f64 = 1e-3;

/// Why this machine cannot run on CUDA (the error's text), or `None` when it can.
fn no_cuda() -> Option<String> {
    let output = pleat(&["run", "tiny", "--device", "cuda", "--batch", "1", "--seq", "8"]);
    (!output.status.success()).then(|| String::from_utf8_lossy(&output.stderr).into_owned())
}

/// Prints, past the test harness's capture, that `case` was skipped and why.
fn skipped(case: &str, reason: &str) {
    let reason = reason.lines().next().unwrap_or_default();
    let _ = writeln!(std::io::stderr(), "skipped: no CUDA device ({case}): {reason}");
}

#[test]
#[cfg(feature = "cuda")]
fn without_a_device_the_run_fails_at_once_naming_what_is_missing() {
    let Some(stderr) = no_cuda() else {
        let _ = writeln!(std::io::stderr(), "a CUDA device is present: the no-device error is not exercised here");
        return;
    };
    assert!(stderr.contains("E0607"), "{stderr}");
    assert!(stderr.contains("no CUDA device"), "{stderr}");
    // It names the missing piece: the driver library, a device, cuBLAS or the architecture.
    assert!(
        ["libcuda", "device", "cuBLAS", "sm_"].iter().any(|missing| stderr.contains(missing)),
        "the error says what is missing: {stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
#[cfg(not(feature = "cuda"))]
fn without_the_feature_device_cuda_says_to_rebuild_with_it() {
    for training in [&[][..], &["--train", "--steps", "1"]] {
        let mut args = vec!["run", "tiny", "--device", "cuda"];
        args.extend(training);
        let stderr = error_of(&args);
        assert!(stderr.contains("E0545") && stderr.contains("--features cuda"), "{args:?}: {stderr}");
    }
}

#[test]
#[cfg(feature = "cuda")]
fn without_a_device_training_fails_at_once_too() {
    if no_cuda().is_none() {
        let _ = writeln!(std::io::stderr(), "a CUDA device is present: the no-device error is not exercised here");
        return;
    }
    let stderr = error_of(&["run", "tiny", "--train", "--steps", "1", "--device", "cuda"]);
    assert!(stderr.contains("E0607") && stderr.contains("no CUDA device"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn device_cuda_refuses_the_cpu_runtimes_own_flags() {
    for training in [&[][..], &["--train", "--steps", "1"]] {
        let mut args = vec!["run", "tiny", "--device", "cuda", "--native"];
        args.extend(training);
        let stderr = error_of(&args);
        assert!(stderr.contains("E0546") && stderr.contains("--native"), "{args:?}: {stderr}");
    }
}

#[test]
fn warmup_is_for_a_forward_pass_on_the_gpu() {
    let stderr = error_of(&["run", "tiny", "--warmup", "1"]);
    assert!(stderr.contains("E0547") && stderr.contains("--device cuda"), "{stderr}");
    let stderr = error_of(&["run", "tiny", "--warmup", "1", "--device", "cuda", "--train", "--steps", "1"]);
    assert!(stderr.contains("E0730") && stderr.contains("--warmup"), "{stderr}");
}

/// Runs `pleat run tiny` on the device (batch 2 × seq 16, `--check`, JSON) for each (mesh,
/// strategy, precision) of `cases` with the `extra` flags, handing `check` each case's name and
/// report; without a device, prints a `skipped` line for each case instead.
fn on_the_device(label: &str, cases: &[(&str, &str, &str)], extra: &[&str], check: impl Fn(&str, &serde_json::Value)) {
    let missing = no_cuda();
    for &(mesh, strategy, precision) in cases {
        let case = format!("{label}mesh '{mesh}', strategy {strategy}, {precision}");
        if let Some(reason) = &missing {
            skipped(&case, reason);
            continue;
        }
        let mut args = vec!["run", "tiny", "--mesh", mesh, "--strategy", strategy, "--precision", precision];
        args.extend(["--device", "cuda", "--batch", "2", "--seq", "16", "--check", "--format", "json"]);
        args.extend(extra);
        let report = json_of(&args);
        // The GEMMs at least ran on the GPU on every rank.
        let on_device = report["device"]["on_device_per_rank"].as_array().expect("on_device_per_rank");
        assert!(on_device.iter().all(|count| count.as_u64().unwrap_or(0) > 0), "{case}: {on_device:?}");
        check(&case, &report);
    }
}

/// Every layout of `tiny` the equivalence matrix runs, on the device against the reference; and
/// two in bf16 (GEMMs on cublasGemmEx, the generated kernels on bf16 buffers), held to the bf16
/// tolerance the run reports.
#[test]
fn every_layout_on_the_device_matches_the_reference() {
    let cases = [
        ("", "auto", "f32"),
        ("tp=2", "tp", "f32"),
        ("tp=4", "tp-sp", "f32"),
        ("tsp=2", "tsp", "f32"),
        ("tsp=4", "tsp", "f32"),
        ("dp=2", "dp", "f32"),
        ("cp=2", "cp", "f32"),
        ("dp=2,tp=2", "auto", "f32"),
        ("dp=2,tsp=2", "auto", "f32"),
        ("", "auto", "bf16"),
        ("tp=2", "tp", "bf16"),
    ];
    on_the_device("", &cases, &[], |case, report| {
        let err = report["max_abs_err"].as_f64().expect("max_abs_err");
        // f32's GPU tolerance; bf16's is the run's own (relative to the largest logit).
        let f32_case = case.ends_with("f32");
        let tolerance = if f32_case { CUDA_F32_TOL } else { report["tolerance"].as_f64().expect("tolerance") };
        assert!(err <= tolerance, "{case}: max |logits - reference| = {err:e}, past {tolerance:e}");
    });
}

/// A forward pass run after a warm-up gives the reference's logits too (the warm-up's results are
/// dropped, its buffers freed).
#[test]
fn a_warmed_up_run_on_the_device_matches_the_reference() {
    on_the_device("after a warm-up, ", &[("tp=2", "tp", "f32")], &["--warmup", "1"], |case, report| {
        let err = report["max_abs_err"].as_f64().expect("max_abs_err");
        assert!(err <= CUDA_F32_TOL, "{case}: max |logits - reference| = {err:e}");
    });
}

/// Training on the device: each step's forward and backward on the GPU, the optimizer on the host;
/// each step's loss and the first step's gradients against the reference, within the tolerances
/// the run states (f32's widened to the GPU's; bf16's its own); the updates are reported.
#[test]
fn training_on_the_device_matches_the_reference() {
    let cases = [
        ("", "auto", "f32"),
        ("tp=2", "tp", "f32"),
        ("dp=2", "dp", "f32"),
        ("tsp=2", "tsp", "f32"),
        ("", "auto", "bf16"),
    ];
    on_the_device("training, ", &cases, &["--train", "--steps", "3"], |case, report| {
        let tolerances = &report["tolerances"];
        for (err, tol) in [("max_loss_err", "loss"), ("max_grad_rel_err", "grad_rel")] {
            let (err, tol) = (report[err].as_f64().expect(err), tolerances[tol].as_f64().expect(tol));
            assert!(err <= tol, "{case}: {err:e} past {tol:e}");
        }
        if case.ends_with("f32") {
            assert_eq!(tolerances["loss"].as_f64(), Some(CUDA_F32_TOL), "{case}: the GPU's f32 tolerance");
            let update = report["max_update_rel_err"].as_f64();
            assert!(update.is_some_and(f64::is_finite), "{case}: the updates are measured: {update:?}");
            assert!(tolerances["update_rel"].is_null(), "{case}: and reported, not judged, on a GPU");
        }
        let execution = report["execution_per_rank"].as_array();
        assert!(execution.is_some_and(|ranks| ranks.iter().all(|rank| rank == "cuda")), "{case}: {execution:?}");
    });
}
