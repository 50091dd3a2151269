//! Running the `pleat` binary from tests: its output, its errors, its JSON, and scratch directories.

#![allow(dead_code, reason = "each test binary uses a different part")]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// Runs `pleat` with `args`.
pub fn pleat(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pleat")).args(args).env("NO_COLOR", "1").output().expect("pleat runs")
}

/// Runs the shell `command` under `script` (util-linux), which gives it a pseudo-terminal: whether
/// it succeeded, and what the terminal showed (stdout and stderr together).
pub fn on_terminal(command: &str) -> (bool, String) {
    let output = Command::new("script")
        .args(["-qec", command, "/dev/null"])
        .env_remove("NO_COLOR")
        .output()
        .expect("script (util-linux) runs");
    (output.status.success(), String::from_utf8_lossy(&output.stdout).into_owned())
}

/// The standard output of a run that must succeed.
#[track_caller]
pub fn stdout_of(args: &[&str]) -> String {
    let output = pleat(args);
    assert!(output.status.success(), "pleat {args:?} failed: {}", String::from_utf8_lossy(&output.stderr));
    String::from_utf8(output.stdout).expect("utf-8")
}

/// The standard error of a run that must fail with exit code 1 (an error, not a panic's 101).
#[track_caller]
pub fn error_of(args: &[&str]) -> String {
    let output = pleat(args);
    assert!(!output.status.success(), "pleat {args:?} should fail");
    assert_eq!(output.status.code(), Some(1), "an error exits 1, not a panic's 101");
    String::from_utf8(output.stderr).expect("utf-8")
}

/// The JSON a successful run prints.
#[track_caller]
pub fn json_of(args: &[&str]) -> serde_json::Value {
    serde_json::from_str(&stdout_of(args)).expect("json output")
}

/// A fresh scratch directory, its own for each call, removed (with what it holds) when the guard
/// is dropped: a test binds it for as long as it reads the directory.
pub fn tempdir(name: &str) -> TempDir {
    // Tests of one binary run in parallel threads of one process: each call gets its own
    // directory, or two tests writing different files under the same name would race.
    static CALLS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!("pleat-test-{name}-{}-{call}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    TempDir(dir)
}

/// Writes `config` (a Hugging Face `config.json`) into `dir` and returns its path, for a model
/// that no preset or fixture is.
pub fn config_file(dir: &Path, config: &serde_json::Value) -> String {
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).expect("write the config");
    path.to_str().expect("a UTF-8 path").to_string()
}

/// A scratch directory that `tempdir` made, removed on drop (else every run of the suite would
/// leave its compiled directories and checkpoints behind).
#[derive(Debug)]
pub struct TempDir(PathBuf);

impl std::ops::Deref for TempDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for TempDir {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The tolerance of a checked training run's losses and relative gradient errors (`--check`).
pub const TRAIN_TOL: f64 = 1e-4;

/// Asserts a checked `pleat run --train --format json` report matches the reference: losses and
/// gradients within `TRAIN_TOL`, updates within the tolerance the report states, losses finite.
#[track_caller]
pub fn assert_matches_reference(report: &serde_json::Value, what: &str) {
    let loss = report["max_loss_err"].as_f64().expect("max_loss_err");
    let rel = report["max_grad_rel_err"].as_f64().expect("max_grad_rel_err");
    assert!(loss <= TRAIN_TOL && rel <= TRAIN_TOL, "{what}: max_loss_err {loss:e}, max_grad_rel_err {rel:e}");
    // Each parameter's update is held to 1e-2 of the reference's (`UPDATE_REL_TOL` says why). The
    // report states it and the command enforces it.
    let update = report["max_update_rel_err"].as_f64().expect("max_update_rel_err");
    let update_tol = report["tolerances"]["update_rel"].as_f64().expect("update tolerance");
    assert!(update <= update_tol, "{what}: max_update_rel_err {update:e} over {update_tol:e}");
    let losses = report["losses"].as_array().expect("losses");
    assert!(losses.iter().all(|loss| loss.as_f64().is_some_and(f64::is_finite)), "{what}: {losses:?}");
}
