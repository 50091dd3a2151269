//! Compiled directories are atomic and sealed: a `pleat compile` killed at any moment leaves the
//! previous directory whole (or none), never a torn one, and a directory changed after it was
//! written is refused by `pleat run` before anything runs.

use std::process::Command;
use std::time::Duration;

#[path = "support/cli.rs"]
mod cli;

use cli::{error_of, stdout_of, tempdir};

/// `tiny` with many layers: small tensors (so running it is quick) and a compile long enough to be
/// killed in the middle of.
fn deep_tiny(dir: &std::path::Path) -> String {
    let tiny =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/examples/tiny/config.json")).expect("tiny");
    let path = dir.join("deep-tiny.json");
    std::fs::write(&path, tiny.replace("\"num_hidden_layers\": 2", "\"num_hidden_layers\": 192")).expect("writes");
    path.to_str().expect("utf-8").to_string()
}

fn compile_args<'a>(model: &'a str, mesh: &'a str, out: &'a str) -> Vec<&'a str> {
    vec!["compile", model, "--mesh", mesh, "--batch", "2", "--seq", "16", "--out", out]
}

/// The plan hash `plan.json` records, or `None` when there is no `plan.json`.
fn recorded_hash(dir: &std::path::Path) -> Option<String> {
    let text = std::fs::read_to_string(dir.join("plan.json")).ok()?;
    let plan: serde_json::Value = serde_json::from_str(&text).expect("plan.json is whole JSON");
    Some(plan["plan_hash"].as_str().expect("a hash").to_string())
}

#[test]
fn a_killed_compile_leaves_the_old_directory_or_none() {
    let dir = tempdir("killed-compile");
    let model = deep_tiny(&dir);
    let out = dir.join("model");
    let out_str = out.to_str().expect("utf-8");
    let fresh = dir.join("fresh");
    stdout_of(&compile_args(&model, "tp=2", out_str));
    stdout_of(&compile_args(&model, "tp=4", fresh.to_str().expect("utf-8")));
    let (old, new) = (recorded_hash(&out).expect("written"), recorded_hash(&fresh).expect("written"));
    assert_ne!(old, new);
    // Kill a compile over the old directory at a spread of moments: before, during and after its
    // writes. Each time, what is there is one whole directory, old or new, or nothing.
    for delay_ms in [0u64, 5, 10, 20, 40, 80, 120, 160, 240, 400] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pleat"))
            .args(compile_args(&model, "tp=4", out_str))
            .stdout(std::process::Stdio::null())
            .spawn()
            .expect("pleat starts");
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = child.kill();
        let _ = child.wait();
        match recorded_hash(&out) {
            Some(hash) => {
                assert!(hash == old || hash == new, "after a kill at {delay_ms} ms: plan hash {hash}");
                // `pleat run` reads every file back and checks it against the hash.
                stdout_of(&["run", out_str]);
            }
            None => assert!(!out.exists(), "a directory without plan.json after a kill at {delay_ms} ms"),
        }
    }
}

#[test]
fn a_changed_directory_is_refused() {
    let dir = tempdir("tampered");
    let out = dir.join("tiny");
    let out_str = out.to_str().expect("utf-8");
    stdout_of(&["compile", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--out", out_str]);
    let program = out.join("rank1.program");
    let text = std::fs::read_to_string(&program).expect("reads");
    std::fs::write(&program, text.replacen("\"name\"", "\"name\" ", 1)).expect("writes");
    let message = error_of(&["run", out_str]);
    assert!(message.contains("the directory was changed after `pleat compile` wrote it"), "{message}");
}

#[test]
fn a_training_directorys_optimizer_layouts_are_in_its_hash() {
    // A rank's optimizer layout says which rows its AdamW updates: an edited one would update the
    // wrong rows, so it is refused like an edited program.
    let dir = tempdir("tampered-training");
    let out = dir.join("tiny");
    let out_str = out.to_str().expect("utf-8");
    let args = ["compile", "tiny", "--train", "--mesh", "dp=2", "--zero", "1", "--batch", "2", "--seq", "16"];
    stdout_of(&[&args[..], &["--out", out_str]].concat());
    stdout_of(&["run", out_str, "--train", "--steps", "1"]);
    let layout = out.join("rank1.optimizer.json");
    let text = std::fs::read_to_string(&layout).expect("reads");
    let edited = text.replacen("\"counts_in_norm\": true", "\"counts_in_norm\": false", 1);
    assert_ne!(edited, text, "rank 1 counts a range in the norm under ZeRO-1");
    std::fs::write(&layout, edited).expect("writes");
    let message = error_of(&["run", out_str, "--train", "--steps", "1"]);
    assert!(message.contains("the directory was changed after `pleat compile` wrote it"), "{message}");
}
