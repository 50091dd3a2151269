//! Running the `pleat` binary from tests: its output, its errors, its JSON, and scratch directories.

#![allow(dead_code, reason = "each test binary uses a different part")]

use std::path::PathBuf;
use std::process::{Command, Output};

/// Runs `pleat` with `args`.
pub fn pleat(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_pleat")).args(args).env("NO_COLOR", "1").output().expect("pleat runs")
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

/// A fresh scratch directory for this test process.
pub fn tempdir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("pleat-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    dir
}
