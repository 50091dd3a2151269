//! `pleat schedule` end to end, and the pipeline schedules' closed forms checked through the
//! public API: the picture of 1F1B on 4 stages (a snapshot), the JSON numbers, the bad-input
//! messages, and a broken schedule reported by the simulation.

#[path = "support/cli.rs"]
mod cli;

use cli::{error_of, json_of, stdout_of};
use pleat_passes::pipeline::{simulate, Phase, Schedule, ScheduleError, ScheduleKind, Step, StepCosts};

#[test]
fn one_f_one_b_picture_on_four_stages() {
    let text = stdout_of(&["schedule", "--pp", "4", "--micro-batches", "8", "--schedule", "1f1b"]);
    insta::assert_snapshot!("schedule_1f1b_pp4_m8", text);
}

#[test]
fn json_numbers_match_the_closed_forms() {
    for (schedule, extra, want) in [
        ("gpipe", None, 3.0 / 8.0),
        ("1f1b", None, 3.0 / 8.0),
        ("interleaved", Some("3"), 3.0 / 24.0),
        ("zb-h1", None, 3.0 / 24.0),
    ] {
        let mut args =
            vec!["schedule", "--pp", "4", "--micro-batches", "8", "--schedule", schedule, "--format", "json"];
        if let Some(chunks) = extra {
            args.extend(["--chunks", chunks]);
        }
        let report = json_of(&args);
        let simulated = report["bubble_over_compute"].as_f64().unwrap();
        let closed = report["closed_form"]["bubble_over_compute"].as_f64().unwrap();
        assert!((simulated - want).abs() < 1e-12, "{schedule}: {simulated} vs {want}");
        assert!((closed - want).abs() < 1e-12, "{schedule}: closed form {closed} vs {want}");
        assert_eq!(report["stages"].as_array().unwrap().len(), 4);
        let makespan = report["makespan"].as_f64().unwrap();
        for stage in report["stages"].as_array().unwrap() {
            let (busy, idle) = (stage["busy"].as_f64().unwrap(), stage["idle"].as_f64().unwrap());
            assert!((busy + idle - makespan).abs() < 1e-12);
        }
    }
    let gpipe = json_of(&["schedule", "--pp", "4", "--micro-batches", "8", "--schedule", "gpipe", "--format", "json"]);
    assert_eq!(gpipe["peak_in_flight"], serde_json::json!([8, 8, 8, 8]));
}

#[test]
fn zero_bubbles_closed_form_is_not_claimed_with_fewer_micro_batches_than_stages() {
    // Qi et al.'s (p-1)(F+B-W)/(m(F+B+W)) is a steady state's: on 4 stages with 2 micro-batches
    // the simulated bubble is 0.8333 where it would say 0.5.
    let args = ["schedule", "--pp", "4", "--micro-batches", "2", "--schedule", "zb-h1"];
    let report = json_of(&[&args[..], &["--format", "json"]].concat());
    assert_eq!(report["closed_form"]["holds"], serde_json::json!(false));
    assert!(report["closed_form"]["bubble_over_compute"].is_null());
    assert!((report["bubble_over_compute"].as_f64().unwrap() - 5.0 / 6.0).abs() < 1e-12);
    assert!(stdout_of(&args).contains("holds for m >= p only, not m=2 < p=4"));
    let steady = json_of(&["schedule", "--pp", "4", "--micro-batches", "4", "--schedule", "zb-h1", "--format", "json"]);
    assert_eq!(steady["closed_form"]["holds"], serde_json::json!(true));
}

#[test]
fn bad_input_says_what_to_use() {
    let err = error_of(&["schedule", "--pp", "4", "--micro-batches", "6", "--schedule", "interleaved"]);
    assert!(err.contains("6 is not a multiple of pp=4; use --micro-batches in {4, 8, 12, 16, ...}"), "{err}");
    let err = error_of(&["schedule", "--pp", "4", "--micro-batches", "8", "--chunks", "2"]);
    assert!(err.contains("--chunks 2 applies to --schedule interleaved only, not to 1f1b"), "{err}");
    let err = error_of(&["schedule", "--pp", "0", "--micro-batches", "8"]);
    assert!(err.contains("stages = 0: give at least 1"), "{err}");
}

#[test]
fn one_f_one_b_holds_p_micro_batches_on_the_first_stage_and_gpipe_m() {
    let one_f_one_b =
        simulate(&Schedule::build(ScheduleKind::OneFOneB, 4, 8).unwrap(), &StepCosts::EQUAL_STAGES).unwrap();
    let gpipe = simulate(&Schedule::build(ScheduleKind::GPipe, 4, 8).unwrap(), &StepCosts::EQUAL_STAGES).unwrap();
    assert_eq!(one_f_one_b.peak_in_flight[0], 4);
    assert_eq!(gpipe.peak_in_flight[0], 8);
}

#[test]
fn a_weight_gradient_before_its_input_gradient_is_reported() {
    let mut schedule = Schedule::build(ScheduleKind::ZeroBubbleH1, 2, 2).unwrap();
    // Stage 0 runs F0 F1 B0 W0 B1 W1; moving W0 first makes it wait on its own later B0.
    let weight = schedule.per_stage[0].iter().position(|step| *step == Step::new(0, Phase::BackwardWeight)).unwrap();
    let moved = schedule.per_stage[0].remove(weight);
    schedule.per_stage[0].insert(0, moved);
    let err = simulate(&schedule, &StepCosts::EQUAL_STAGES).unwrap_err();
    assert!(
        matches!(err, ScheduleError::Deadlock { stage: 0, index: 0, step, waits_for, .. }
            if step == Step::new(0, Phase::BackwardWeight) && waits_for == Step::new(0, Phase::BackwardInput)),
        "{err}"
    );
    assert!(err.to_string().starts_with(
        "the schedule cannot complete: stage 0 waits at step 0 (backward-weight of micro-batch 0 on chunk 0) for backward-input of micro-batch 0 on chunk 0 on stage 0"
    ), "{err}");
}
