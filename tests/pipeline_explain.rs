//! `pleat explain` on a mesh with a pp axis: the stages' layers and the schedule's picture after
//! the values and collectives of one stage's mesh (a snapshot), and the same in JSON; `pleat
//! trace` on one: a measured pipelined training step, its trace file and its picture.

#[path = "support/cli.rs"]
mod cli;

use cli::{json_of, stdout_of};

#[test]
fn explain_draws_the_pipeline() {
    let text = stdout_of(&["explain", "tiny", "--mesh", "pp=2,tp=2", "--schedule", "zb-h1"]);
    let picture = &text[text.find("\npipeline:").expect("a pipeline section")..];
    insta::assert_snapshot!("explain_pp2_tp2_zb_h1", picture);
}

#[test]
fn explain_json_names_the_stages() {
    let report = json_of(&["explain", "tiny", "--mesh", "pp=2", "--micro-batches", "8", "--format", "json"]);
    let pipeline = &report["pipeline"];
    assert_eq!(pipeline["schedule"], "1f1b");
    assert_eq!(pipeline["micro_batches"], 8);
    assert_eq!(pipeline["layers_per_stage"], serde_json::json!([1, 1]));
    let picture = pipeline["picture"].as_str().expect("a picture");
    // Two stage rows, each with every micro-batch's forward and backward.
    let rows: Vec<&str> = picture.lines().filter(|line| line.starts_with("stage ")).collect();
    assert_eq!(rows.len(), 2, "{picture}");
    for row in rows {
        for micro_batch in 0..8 {
            assert!(row.contains(&format!("F{micro_batch}")) && row.contains(&format!("B{micro_batch}")), "{row}");
        }
    }
    // Without pp there is no pipeline.
    let report = json_of(&["explain", "tiny", "--mesh", "tp=2", "--format", "json"]);
    assert!(report["pipeline"].is_null());
}

#[test]
fn trace_draws_a_measured_pipelined_step() {
    let dir = cli::tempdir("pipeline-trace");
    let out = dir.join("trace.json");
    let out = out.to_str().expect("utf-8");
    let text = stdout_of(&[
        "trace",
        "tiny",
        "--mesh",
        "pp=2",
        "--batch",
        "4",
        "--seq",
        "16",
        "--schedule",
        "zb-h1",
        "--out",
        out,
    ]);
    assert!(text.contains("measured trace of one zb-h1 training step"), "{text}");
    let rows: Vec<&str> = text.lines().filter(|line| line.starts_with("stage ")).collect();
    assert_eq!(rows.len(), 2, "{text}");
    // Measured lengths vary, so only that each row draws blocks (a short one may round away).
    assert!(rows.iter().all(|row| row.chars().any(|c| "FBW".contains(c))), "{text}");
    assert!(text.contains("idle share of the step: stage 0: "), "{text}");
    // The trace file holds both ranks' measured slices, sends and receives among them.
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out).expect("a trace")).expect("json");
    let events = trace["traceEvents"].as_array().expect("events");
    for rank in 0..2 {
        assert!(events.iter().any(|event| event["pid"] == rank && event["ph"] == "X"), "no slice of rank {rank}");
    }
}
