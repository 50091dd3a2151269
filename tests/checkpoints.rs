//! Sharded checkpoints (`pleat run --train --save DIR --save-every N --resume DIR`): saving in the
//! middle of a run changes nothing, a resumed run continues bit for bit on the same mesh and within
//! 1e-5 on another (tp=4 resumed at tsp=2 and at dp=2,tp=2; a mixture's ZeRO-3 shards over dp × ep
//! resumed at ep=2), a changed or stale checkpoint is refused, and a run killed at any moment
//! leaves the last complete checkpoint or none.

use std::process::{Command, Stdio};
use std::time::Duration;

#[path = "support/cli.rs"]
mod cli;

use cli::{error_of, json_of, stdout_of, tempdir};
use serde_json::Value;

/// Trains tiny (batch 4, seq 16, lr 1e-2) with `extra` flags and returns the report.
fn train(extra: &[&str]) -> Value {
    let base = ["run", "tiny", "--train", "--batch", "4", "--seq", "16", "--lr", "1e-2", "--format", "json"];
    json_of(&[&base[..], extra].concat())
}

fn losses(report: &Value) -> Vec<f64> {
    report["losses"].as_array().expect("losses").iter().map(|loss| loss.as_f64().expect("a loss")).collect()
}

fn path_in(dir: &std::path::Path, name: &str) -> String {
    dir.join(name).to_str().expect("utf-8").to_string()
}

#[test]
fn saving_every_step_and_resuming_on_the_same_mesh_are_bit_for_bit() {
    let dir = tempdir("ckpt-same-mesh");
    let saved = path_in(&dir, "saved");
    let reference = losses(&train(&["--mesh", "tp=4", "--steps", "7"]));
    // Checkpoints after steps 2 and 4 (and at the end, step 5): the losses are the uninterrupted run's.
    let chunked = losses(&train(&["--mesh", "tp=4", "--steps", "5", "--save-every", "2", "--save", &saved]));
    assert_eq!(chunked, reference[..5], "saving in the middle changed the losses");
    let index: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("saved/index.json")).expect("index")).expect("json");
    assert_eq!((index["format_version"].as_u64(), index["steps"].as_u64()), (Some(2), Some(5)));
    // One file a rank: tp=4 holds four disjoint shards.
    for rank in 0..4 {
        assert!(dir.join(format!("saved/rank{rank}.safetensors")).is_file(), "rank {rank}");
    }
    let resumed = train(&["--mesh", "tp=4", "--steps", "2", "--resume", &saved]);
    assert_eq!(resumed["start_step"], 5);
    assert_eq!(losses(&resumed), reference[5..], "the resumed run is not the uninterrupted one");
}

#[test]
fn a_tp4_checkpoint_resumes_at_tsp2_and_at_dp2_tp2_like_the_uninterrupted_run() {
    let dir = tempdir("ckpt-reshard");
    let saved = path_in(&dir, "tp4");
    let reference = losses(&train(&["--mesh", "tp=4", "--steps", "7"]));
    train(&["--mesh", "tp=4", "--steps", "2", "--save", &saved]);
    for mesh in ["tsp=2", "dp=2,tp=2"] {
        // --check also runs the single-device reference from the same checkpoint.
        let report = train(&["--mesh", mesh, "--steps", "5", "--resume", &saved, "--check"]);
        assert!(report["max_loss_err"].as_f64().expect("checked") <= 1e-4, "{mesh}: {report}");
        let resumed = losses(&report);
        assert_eq!(resumed.len(), 5);
        for (step, (got, want)) in resumed.iter().zip(&reference[2..]).enumerate() {
            assert!((got - want).abs() <= 1e-5, "{mesh} step {}: {got} vs {want}", step + 3);
        }
    }
    // ZeRO-3 splits the blocks by rows another way again; and a checkpoint is a model directory.
    let report = train(&["--mesh", "dp=2", "--zero", "3", "--steps", "1", "--resume", &saved]);
    assert!((losses(&report)[0] - reference[2]).abs() <= 1e-5);
    let inference =
        json_of(&["run", &saved, "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--check", "--format", "json"]);
    assert!(inference["max_abs_err"].as_f64().expect("checked") < 1e-4);
}

#[test]
fn a_mixtures_zero3_checkpoint_over_dp_and_ep_resumes_bit_for_bit_and_reshards() {
    // ZeRO-3 over dp × ep splits a dense parameter's rows four ways and an expert's two: the
    // blocks saved are those shards, and they load back on the same mesh and on another.
    let dir = tempdir("ckpt-moe-zero");
    let saved = path_in(&dir, "saved");
    let moe = |extra: &[&str]| {
        let base = ["run", "tiny-moe", "--train", "--batch", "4", "--seq", "16", "--lr", "1e-2", "--format", "json"];
        json_of(&[&base[..], extra].concat())
    };
    resumes_bit_for_bit_and_reshards(
        &moe,
        &["--mesh", "dp=2,ep=2", "--zero", "3"],
        &["--mesh", "ep=2", "--zero", "1"],
        &saved,
    );
}

/// Trains four steps with `run` on `layout`'s flags, and two saving to `saved`, then resumes the
/// last two from it: on `layout`, where the losses must be the uninterrupted run's bit for bit,
/// and on `other`, where they must be within 1e-5 and checked against the reference.
fn resumes_bit_for_bit_and_reshards(run: &dyn Fn(&[&str]) -> Value, layout: &[&str], other: &[&str], saved: &str) {
    let label = layout.join(" ");
    let reference = losses(&run(&[layout, &["--steps", "4"]].concat()));
    run(&[layout, &["--steps", "2", "--save", saved]].concat());
    let resumed = losses(&run(&[layout, &["--steps", "2", "--resume", saved]].concat()));
    assert_eq!(resumed, reference[2..], "{label}: the resumed run is not the uninterrupted one");
    let report = run(&[other, &["--steps", "2", "--resume", saved, "--check"]].concat());
    assert!(report["max_loss_err"].as_f64().expect("checked") <= 1e-4, "{report}");
    for (got, want) in losses(&report).iter().zip(&reference[2..]) {
        assert!((got - want).abs() <= 1e-5, "{label} on {}: {got} vs {want}", other.join(" "));
    }
}

#[test]
fn a_checkpoint_whose_zero_shards_split_head_dim_resumes_bit_for_bit_and_reshards() {
    // At dp=2 × tp=4 a rank holds one of tiny's 4 kv heads: ZeRO splits k and v over dp on
    // head_dim, so a rank's moments (ZeRO-1) and blocks (ZeRO-3) are runs inside one head. Both
    // save, load back on the same mesh bit for bit, and reshard onto tp=2.
    let dir = tempdir("ckpt-head-dim");
    for zero in ["1", "3"] {
        let saved = path_in(&dir, &format!("zero{zero}"));
        resumes_bit_for_bit_and_reshards(&train, &["--mesh", "dp=2,tp=4", "--zero", zero], &["--mesh", "tp=2"], &saved);
    }
}

#[test]
fn a_changed_or_stale_checkpoint_is_refused() {
    let dir = tempdir("ckpt-tampered");
    let saved = path_in(&dir, "saved");
    train(&["--mesh", "tp=2", "--steps", "1", "--save", &saved]);
    let resume = ["run", "tiny", "--train", "--batch", "4", "--seq", "16", "--steps", "1", "--resume", &saved];
    // One changed byte in a weight: the bytes still parse, only the hash can tell.
    let file = dir.join("saved/rank1.safetensors");
    let original = std::fs::read(&file).expect("reads");
    let mut changed = original.clone();
    let last = changed.len() - 1;
    changed[last] ^= 0x40;
    std::fs::write(&file, &changed).expect("writes");
    let error = error_of(&resume);
    assert!(error.contains("was changed after it was written"), "{error}");
    std::fs::write(&file, &original).expect("writes");
    stdout_of(&resume);
    // Another format version (an old single-file checkpoint has none).
    let index_path = dir.join("saved/index.json");
    let index = std::fs::read_to_string(&index_path).expect("reads");
    std::fs::write(&index_path, index.replacen("\"format_version\": 2", "\"format_version\": 1", 1)).expect("writes");
    let error = error_of(&resume);
    assert!(error.contains("checkpoint format 1 is not 2"), "{error}");
    let error = error_of(&["run", "llama2-7b", "--train", "--resume", &path_in(&dir, "missing")]);
    assert!(error.contains("--resume takes a directory that --save wrote"), "{error}");
}

/// The steps a checkpoint records, or `None` when there is no index.
fn recorded_steps(dir: &std::path::Path) -> Option<u64> {
    let text = std::fs::read_to_string(dir.join("index.json")).ok()?;
    let index: Value = serde_json::from_str(&text).expect("index.json is whole JSON");
    Some(index["steps"].as_u64().expect("steps"))
}

#[test]
fn a_killed_run_leaves_the_last_complete_checkpoint_or_none() {
    let dir = tempdir("ckpt-killed");
    let saved = dir.join("saved");
    let saved_str = saved.to_str().expect("utf-8");
    let args = [
        "run",
        "tiny",
        "--train",
        "--batch",
        "2",
        "--seq",
        "8",
        "--steps",
        "100000",
        "--save-every",
        "1",
        "--save",
        saved_str,
    ];
    // Kill a run saving after every step at a spread of moments: before its first save, during
    // saves, between them. Each later run starts over the directory the last one left.
    for delay_ms in [0u64, 30, 60, 100, 150, 250, 400, 600, 900] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_pleat"))
            .args(args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("pleat starts");
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = child.kill();
        let _ = child.wait();
        match recorded_steps(&saved) {
            Some(steps) => {
                assert!(steps >= 1, "after a kill at {delay_ms} ms: {steps} steps");
                // Resuming reads every block back and checks the content hash.
                let report = json_of(&[
                    "run", "tiny", "--train", "--batch", "2", "--seq", "8", "--steps", "1", "--resume", saved_str,
                    "--format", "json",
                ]);
                assert_eq!(report["start_step"].as_u64(), Some(steps));
            }
            None => assert!(!saved.exists(), "a directory without index.json after a kill at {delay_ms} ms"),
        }
    }
    // A whole run after the kills saves over what they left and removes their staging siblings.
    let finished = ["run", "tiny", "--train", "--batch", "2", "--seq", "8", "--steps", "2", "--save", saved_str];
    stdout_of(&finished);
    assert_eq!(recorded_steps(&saved), Some(2));
    let names: Vec<String> = std::fs::read_dir(&dir)
        .expect("lists")
        .map(|entry| entry.expect("an entry").file_name().to_string_lossy().to_string())
        .collect();
    assert_eq!(names, vec!["saved".to_string()], "stale siblings are left");
}

#[test]
fn a_checkpoint_set_aside_is_put_back_by_any_read_and_one_without_its_index_is_refused() {
    let dir = tempdir("checkpoint-aside");
    let saved = path_in(&dir, "saved");
    stdout_of(&["run", "tiny", "--train", "--steps", "1", "--batch", "2", "--seq", "16", "--save", &saved]);
    let logits = |model: &str, extra: &[&str], name: &str| -> Vec<u8> {
        let out = path_in(&dir, name);
        stdout_of(&[&["run", model, "--batch", "2", "--seq", "16", "--logits-out", &out][..], extra].concat());
        std::fs::read(out).expect("logits")
    };
    let expected = logits(&saved, &[], "expected.safetensors");
    // A write killed between its renames leaves the checkpoint aside (a writer that has ended):
    // `pleat run DIR` and `--weights DIR` put it back, as `--resume` did alone (E0734, E0610).
    for (model, extra) in [(saved.as_str(), &[][..]), ("tiny", &["--weights", saved.as_str()][..])] {
        let aside = dir.join(format!(".saved.old-{}", u32::MAX - 1));
        std::fs::rename(&saved, &aside).expect("set aside");
        assert_eq!(logits(model, extra, "put-back.safetensors"), expected, "{model} {extra:?}");
        assert!(!aside.exists());
    }
    // Without its index the rank files cannot be placed; the directory ran on seeded weights.
    std::fs::remove_file(dir.join("saved").join("index.json")).expect("index removed");
    let error = error_of(&["run", &saved, "--batch", "2", "--seq", "16"]);
    assert!(error.starts_with("error[E0758]") && error.contains("no index.json"), "{error}");
}

#[test]
fn a_run_resumed_at_another_batch_continues_the_data_where_the_checkpoint_stopped() {
    // 3 steps of 4 sequences of 16 take tokens 0..192 of the file. Resumed at 2 sequences a step,
    // the run read from 3·2·16 = 96 on, training again on tokens it had seen, with no warning.
    let dir = tempdir("resume-data");
    let file = |name: &str, changed: std::ops::Range<usize>| -> String {
        let ids: Vec<String> =
            (0..1000usize).map(|at| if changed.contains(&at) { 7 } else { (at * 37 + 11) % 256 }.to_string()).collect();
        let path = path_in(&dir, name);
        std::fs::write(&path, ids.join(" ")).expect("data written");
        path
    };
    let (data, seen_again, unseen) = (file("a.txt", 0..0), file("b.txt", 96..192), file("c.txt", 192..256));
    let saved = path_in(&dir, "saved");
    let args = ["run", "tiny", "--train", "--seq", "16", "--lr", "0.01", "--format", "json"];
    json_of(&[&args[..], &["--batch", "4", "--steps", "3", "--data", &data, "--save", &saved]].concat());
    let resumed = |data: &str| {
        losses(&json_of(&[&args[..], &["--batch", "2", "--steps", "2", "--data", data, "--resume", &saved]].concat()))
    };
    let continued = resumed(&data);
    assert_eq!(resumed(&seen_again), continued, "tokens 96..192 were trained on before the checkpoint");
    assert_ne!(resumed(&unseen), continued, "tokens 192.. are where the stream continues");
}
