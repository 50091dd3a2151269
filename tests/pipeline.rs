//! Pipeline-parallel training (`--mesh pp=...`) against the single-device reference, its
//! composition with the other axes, the memory each schedule holds, and the programs' static
//! deadlock check on a schedule that cannot run.

#[path = "support/cli.rs"]
mod cli;

use cli::{assert_matches_reference, error_of, json_of};
use serde_json::Value;

/// tiny with four layers, as a config.json in a fresh directory (removed when the guard drops).
fn four_layers() -> (cli::TempDir, String) {
    tiny_with_layers(4)
}

/// tiny with `layers` layers, as a config.json in a fresh directory (removed when the guard drops).
fn tiny_with_layers(layers: u64) -> (cli::TempDir, String) {
    let dir = cli::tempdir("pipeline");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string("examples/tiny/config.json").expect("tiny's config"))
            .expect("json");
    config["num_hidden_layers"] = Value::from(layers);
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).expect("write config");
    let path = path.to_str().expect("utf-8").to_string();
    (dir, path)
}

fn train(model: &str, mesh: &str, extra: &[&str]) -> Value {
    let mut args = vec![
        "run", model, "--train", "--mesh", mesh, "--batch", "8", "--seq", "16", "--steps", "5", "--check", "--format",
        "json",
    ];
    args.extend_from_slice(extra);
    json_of(&args)
}

#[test]
fn every_schedule_and_depth_matches_the_reference() {
    let (_dir, model) = four_layers();
    for mesh in ["pp=2", "pp=4"] {
        for schedule in ["gpipe", "1f1b"] {
            for micro_batches in ["4", "8"] {
                let report = train(&model, mesh, &["--schedule", schedule, "--micro-batches", micro_batches]);
                assert_matches_reference(&report, &format!("{mesh} {schedule} m={micro_batches}"));
            }
        }
    }
}

#[test]
fn zero_bubble_h1_matches_the_reference() {
    // The backward split into input-gradient and weight-gradient steps, the weight gradients
    // deferred by the stage index: the same losses, gradients and weights as the reference.
    let (_dir, model) = four_layers();
    for mesh in ["pp=2", "pp=4"] {
        for micro_batches in ["4", "8"] {
            let report = train(&model, mesh, &["--schedule", "zb-h1", "--micro-batches", micro_batches]);
            assert_matches_reference(&report, &format!("{mesh} zb-h1 m={micro_batches}"));
        }
    }
    let report = train(&model, "pp=2,tp=2", &["--schedule", "zb-h1", "--micro-batches", "4"]);
    assert_matches_reference(&report, "pp=2,tp=2 zb-h1");
}

#[test]
fn interleaved_one_f_one_b_matches_the_reference() {
    // Four layers in pp·v = 4 virtual stages: rank 0 holds layers 0 and 2, rank 1 layers 1 and 3,
    // so activations go 0 -> 1 -> 0 -> 1 and the queue from rank 0 to rank 1 carries chunk 0's
    // activations and chunk 1's gradients interleaved.
    let (_dir, model) = four_layers();
    for (mesh, micro_batches) in [("pp=2", "2"), ("pp=2", "4"), ("pp=2,tp=2", "4")] {
        let report =
            train(&model, mesh, &["--schedule", "interleaved", "--chunks", "2", "--micro-batches", micro_batches]);
        assert_matches_reference(&report, &format!("{mesh} interleaved v=2 m={micro_batches}"));
    }
    // pp=4 with v=2 needs eight virtual stages: eight layers, one a virtual stage.
    let (_eight_dir, eight) = tiny_with_layers(8);
    let report = train(&eight, "pp=4", &["--schedule", "interleaved", "--chunks", "2", "--micro-batches", "4"]);
    assert_matches_reference(&report, "pp=4 interleaved v=2 m=4");
}

#[test]
fn every_schedule_composes_with_tsp() {
    let (_dir, model) = four_layers();
    for schedule in ["gpipe", "1f1b", "zb-h1"] {
        let report = train(&model, "pp=2,tsp=2", &["--schedule", schedule, "--micro-batches", "4"]);
        assert_matches_reference(&report, &format!("pp=2,tsp=2 {schedule}"));
    }
    let report = train(&model, "pp=2,tsp=2", &["--schedule", "interleaved", "--chunks", "2", "--micro-batches", "2"]);
    assert_matches_reference(&report, "pp=2,tsp=2 interleaved");
}

#[test]
fn tied_embeddings_pipeline_like_the_reference() {
    // The LM head on the last stage reads the embedding table the first stage owns; its part of
    // the table's gradient travels back and is summed on the first stage.
    let dir = cli::tempdir("pipeline-tied");
    let mut config: Value =
        serde_json::from_str(&std::fs::read_to_string("examples/tiny/config.json").expect("tiny's config"))
            .expect("json");
    config["tie_word_embeddings"] = Value::Bool(true);
    config["num_hidden_layers"] = Value::from(4);
    let path = dir.join("config.json");
    std::fs::write(&path, config.to_string()).expect("write config");
    let path = path.to_str().expect("utf-8");
    for schedule in ["1f1b", "gpipe", "zb-h1"] {
        let report = train(path, "pp=2", &["--schedule", schedule, "--micro-batches", "4"]);
        assert_matches_reference(&report, &format!("tied pp=2 {schedule}"));
    }
    // Under ZeRO-3 the last stage gathers the table's dp shard itself for its backward: gathered
    // again on the first stage, whose backward runs after the last's, the two deadlocked.
    for (mesh, schedule) in [("pp=2,dp=2", "1f1b"), ("pp=2,dp=2", "zb-h1"), ("pp=2,dp=2,tp=2", "interleaved")] {
        let args = ["--schedule", schedule, "--micro-batches", "4", "--zero", "3", "--recompute", "full"];
        assert_matches_reference(&train(path, mesh, &args), &format!("tied {mesh} {schedule} zero=3"));
    }
}

#[test]
fn pipelines_compose_with_the_other_axes() {
    let (_dir, model) = four_layers();
    for (mesh, extra) in [
        ("pp=2,tp=2", &[][..]),
        ("pp=2,tsp=2", &[][..]),
        ("pp=2,dp=2", &["--zero", "2"][..]),
        ("pp=2,tp=2", &["--strategy", "tp-sp"][..]),
        // SP beside cp gathers each layer's output whole over tp; under full recomputation that
        // copy is kept as the residual stream (a stage recomputing the one it sent deadlocked).
        ("pp=2,tp=2,cp=2", &["--strategy", "tp-sp", "--recompute", "full"][..]),
        ("pp=2", &["--pp-layers", "3,1"][..]),
    ] {
        let args = [&["--micro-batches", "2"][..], extra].concat();
        assert_matches_reference(&train(&model, mesh, &args), mesh);
    }
}

#[test]
fn gradient_accumulation_gives_the_unsplit_step() {
    for mesh in ["tp=2", "dp=2"] {
        assert_matches_reference(&train("tiny", mesh, &["--micro-batches", "4"]), mesh);
    }
}

#[test]
fn one_f_one_b_holds_stages_not_micro_batches() {
    // m = 8, p = 4, two sequences of 64 tokens a micro-batch, so activations dominate: GPipe's first
    // stage holds all 8 micro-batches' activations before its first backward, 1F1B's at most 4
    // (p), so GPipe's activation peak is about twice 1F1B's (8/4, less the gradients both hold).
    let (_dir, model) = four_layers();
    let peak = |schedule: &str| {
        let report = json_of(&[
            "run",
            &model,
            "--train",
            "--mesh",
            "pp=4",
            "--batch",
            "16",
            "--seq",
            "64",
            "--steps",
            "1",
            "--micro-batches",
            "8",
            "--schedule",
            schedule,
            "--format",
            "json",
        ]);
        report["activation_peak_bytes_per_rank"][0].as_f64().expect("a number")
    };
    let ratio = peak("gpipe") / peak("1f1b");
    assert!(ratio >= 1.5, "GPipe over 1F1B on the first stage: {ratio:.3}");
}

#[test]
fn bad_pipelines_are_refused() {
    let (_dir, model) = four_layers();
    let error = error_of(&["run", &model, "--train", "--mesh", "pp=2", "--pp-layers", "3,2"]);
    assert!(error.contains("the counts sum to 5, the model has 4 layers"), "{error}");
    let error = error_of(&["run", &model, "--train", "--mesh", "pp=2", "--batch", "8", "--micro-batches", "3"]);
    assert!(error.contains("--batch 8 does not split into --micro-batches 3"), "{error}");
    let error = error_of(&["run", "tiny", "--train", "--mesh", "pp=4"]);
    assert!(error.contains("pp=4 needs at least one layer a stage, and the model has 2 layers"), "{error}");
    let error =
        error_of(&["run", "tiny", "--train", "--mesh", "pp=2", "--schedule", "interleaved", "--micro-batches", "2"]);
    assert!(error.contains("error[E0791]") && error.contains("4 virtual stages"), "{error}");
    let error = error_of(&["run", &model, "--train", "--mesh", "pp=2", "--schedule", "1f1b", "--chunks", "2"]);
    assert!(error.contains("--chunks 2 applies to --schedule interleaved only"), "{error}");
}

#[test]
fn a_schedule_that_cannot_run_is_a_deadlock_the_verifier_names() {
    use pleat_backend::pipeline::{pipeline_programs, stage_of_nodes, Phase, PipelinePlan, ScheduleStep};
    let config = pleat_ir::model::preset::preset("tiny").expect("tiny");
    let mut module = pleat_ir::model::build_training(&config, 1, 16).expect("builds");
    pleat_passes::run_pipeline(pleat_passes::TRAIN_PIPELINE, &mut module, &pleat_passes::PassCtx::default())
        .expect("differentiates");
    let stage_of = stage_of_nodes(&module, 2, None, config.num_layers).expect("two stages");
    let step = |micro_batch, phase| ScheduleStep { micro_batch, chunk: 0, phase };
    let (forward, backward) = (Phase::Forward, Phase::Backward);
    // Stage 0 waits for micro-batch 0's gradient before sending micro-batch 1's activations, while
    // stage 1 wants micro-batch 1's activations before it returns micro-batch 0's gradient.
    let schedule = vec![
        vec![step(0, forward), step(0, backward), step(1, forward), step(1, backward)],
        vec![step(0, forward), step(1, forward), step(0, backward), step(1, backward)],
    ];
    let plan = PipelinePlan { stage_of: &stage_of, schedule: &schedule, micro_batches: 2, chunks: 1 };
    let programs = pipeline_programs(&module, &plan).expect("each stage's program is well formed");
    let error = pleat_backend::verify_collectives(&programs).unwrap_err().to_string();
    assert!(error.contains("rank 0 at instruction") && error.contains("waits for a message from rank 1"), "{error}");
    assert!(error.contains("rank 1 at instruction") && error.contains("waits for a message from rank 0"), "{error}");
    // Neighbouring stages that order their micro-batches differently are refused before lowering.
    let swapped = vec![
        vec![step(0, forward), step(1, forward), step(0, backward), step(1, backward)],
        vec![step(1, forward), step(0, forward), step(0, backward), step(1, backward)],
    ];
    let plan = PipelinePlan { stage_of: &stage_of, schedule: &swapped, micro_batches: 2, chunks: 1 };
    let error = pipeline_programs(&module, &plan).unwrap_err().to_string();
    assert!(error.contains("stages 0 and 1 run the Forward of the micro-batches in different orders"), "{error}");
}

#[test]
fn zero_bubbles_first_stage_holds_about_one_f_one_bs_activations() {
    // ZB-H1 runs a due W right after its B, before the next forward, so its first stage holds
    // 1F1B's p micro-batches, not p + 1 (11% more activations here when the next forward ran
    // first); what it holds beyond 1F1B is B's and W's split buffers. Bytes, not times.
    let (_dir, model) = tiny_with_layers(4);
    let first_stage_activations = |schedule: &str| -> f64 {
        let args = ["run", &model, "--train", "--mesh", "pp=4", "--batch", "8", "--seq", "32", "--steps", "1"];
        let report =
            json_of(&[&args[..], &["--micro-batches", "8", "--schedule", schedule, "--format", "json"]].concat());
        report["activation_peak_bytes_per_rank"][0].as_f64().expect("bytes")
    };
    let (one_f_one_b, zero_bubble) = (first_stage_activations("1f1b"), first_stage_activations("zb-h1"));
    assert!(zero_bubble <= 1.02 * one_f_one_b, "zb-h1 {zero_bubble} against 1f1b {one_f_one_b}");
}
