//! `pleat trace` and `pleat run --trace`: both write Chrome trace-event JSON with one process a
//! rank, a compute and a comm thread in each, and slices named by op and layer. Never asserts times.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use pleat_runtime::weights::SeededWeights;
use serde_json::Value;

#[path = "support/cli.rs"]
mod cli;
mod common;
#[path = "support/trace.rs"]
mod trace_events;

use cli::{error_of, stdout_of, tempdir};
use trace_events::{read, some_rank_overlaps, Tracks};

fn pleat(args: &[&str]) {
    cli::stdout_of(args);
}

/// Checks the structure every trace of `ranks` ranks must have; returns the slices' names by
/// (rank, thread).
fn check(events: &[Value], ranks: u64) -> BTreeMap<(u64, u64), Vec<String>> {
    let mut processes = BTreeMap::new();
    let mut threads = BTreeSet::new();
    let mut tracks: Tracks = BTreeMap::new();
    for event in events {
        let pid = event["pid"].as_u64().expect("pid");
        let tid = event["tid"].as_u64().expect("tid");
        match (event["ph"].as_str().expect("ph"), event["name"].as_str().expect("name")) {
            ("M", "process_name") => {
                processes.insert(pid, event["args"]["name"].as_str().expect("a process name").to_string());
            }
            ("M", "thread_name") => {
                threads.insert((pid, tid, event["args"]["name"].as_str().expect("a thread name").to_string()));
            }
            ("M", _) => {}
            ("X", name) => {
                let start = event["ts"].as_f64().expect("ts");
                let duration = event["dur"].as_f64().expect("dur");
                assert!(start >= 0.0 && duration >= 0.0, "{name}: ts {start} dur {duration}");
                assert!(event["args"]["bytes"].is_u64() && event["args"]["flops"].is_u64(), "{name}: args");
                if name.starts_with("matmul ") {
                    assert!(event["args"]["flops"].as_u64().unwrap() > 0, "{name} does flops");
                }
                tracks.entry((pid, tid)).or_default().push((start, duration, name.to_string()));
            }
            (phase, name) => panic!("unexpected event {phase} {name}"),
        }
    }
    for rank in 0..ranks {
        assert_eq!(processes.get(&rank).map(String::as_str), Some(format!("rank {rank}").as_str()));
        assert!(threads.contains(&(rank, 0, "compute".to_string())), "rank {rank} has no compute thread");
        assert!(threads.contains(&(rank, 1, "comm".to_string())), "rank {rank} has no comm thread");
        assert!(tracks.contains_key(&(rank, 0)), "rank {rank} computes nothing");
    }
    assert_eq!(processes.len() as u64, ranks);
    // Within a track the slices follow one another: each starts no earlier than the last ended.
    for ((pid, tid), slices) in &tracks {
        for pair in slices.windows(2) {
            let ((start, duration, name), (next_start, _, next)) = (&pair[0], &pair[1]);
            let slack = 1e-6 * (start + duration).abs().max(1.0);
            assert!(*next_start + slack >= start + duration, "rank {pid} thread {tid}: {next} overlaps {name}");
        }
    }
    tracks.into_iter().map(|(track, slices)| (track, slices.into_iter().map(|(_, _, name)| name).collect())).collect()
}

fn names(tracks: &BTreeMap<(u64, u64), Vec<String>>, rank: u64, tid: u64) -> Vec<String> {
    tracks.get(&(rank, tid)).cloned().unwrap_or_default()
}

#[test]
fn predicted_tp_trace_has_all_reduces_on_the_comm_track() {
    let dir = tempdir("tp");
    let out = dir.join("tp.json");
    pleat(&["trace", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--out", out.to_str().unwrap()]);
    let tracks = check(&read(&out), 2);
    for rank in 0..2 {
        let comm = names(&tracks, rank, 1);
        assert!(comm.iter().any(|name| name.starts_with("all_reduce layer0.")), "rank {rank}: {comm:?}");
        let compute = names(&tracks, rank, 0);
        assert!(compute.iter().any(|name| name.starts_with("matmul layer1.")), "rank {rank}: {compute:?}");
        assert!(compute.iter().any(|name| name.starts_with("attention layer0.")), "rank {rank}: {compute:?}");
        assert!(compute.iter().all(|name| !name.starts_with("all_reduce")), "collectives stay off compute");
    }
    let leftovers: Vec<_> = std::fs::read_dir(&dir).unwrap().map(|entry| entry.unwrap().file_name()).collect();
    assert_eq!(leftovers.len(), 1, "no temporary file is left: {leftovers:?}");
}

#[test]
fn predicted_tsp_trace_has_broadcasts_and_ring_messages() {
    let dir = tempdir("tsp");
    let out = dir.join("tsp.json");
    pleat(&[
        "trace",
        "tiny",
        "--mesh",
        "tsp=2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--hw",
        "cpu",
        "--out",
        out.to_str().unwrap(),
    ]);
    let events = read(&out);
    let tracks = check(&events, 2);
    for rank in 0..2 {
        // The owners' blocks are prefetched on the rank's second stream, the ring on the first.
        let thread = |tid: u64, name: &str| {
            events.iter().any(|event| {
                event["name"] == "thread_name"
                    && event["pid"] == rank
                    && event["tid"] == tid
                    && event["args"]["name"] == name
            })
        };
        assert!(thread(2, "prefetch"), "rank {rank} has no prefetch thread");
        let prefetch = names(&tracks, rank, 2);
        assert!(prefetch.iter().any(|name| name.starts_with("broadcast layer0.attn.")), "rank {rank}: {prefetch:?}");
        assert!(prefetch.iter().all(|name| name.starts_with("broadcast ")), "rank {rank}: {prefetch:?}");
        let comm = names(&tracks, rank, 1);
        assert!(comm.iter().any(|name| name.starts_with("send ")), "rank {rank}: {comm:?}");
        assert!(comm.iter().any(|name| name.starts_with("recv layer0.mlp_ring")), "rank {rank}: {comm:?}");
    }
}

#[test]
fn run_writes_the_measured_trace() {
    let dir = tempdir("run");
    let out = dir.join("measured.json");
    pleat(&["run", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--trace", out.to_str().unwrap()]);
    let tracks = check(&read(&out), 2);
    for rank in 0..2 {
        let comm = names(&tracks, rank, 1);
        assert!(comm.iter().any(|name| name.starts_with("all_reduce layer1.")), "rank {rank}: {comm:?}");
        assert!(names(&tracks, rank, 0).iter().any(|name| name.starts_with("matmul layer0.")));
    }
}

#[test]
fn executor_times_every_instruction_in_order() {
    let config = pleat_ir::model::preset::preset("tiny").unwrap();
    let (_, programs) = common::compile(&config, 2, 16, "tp=2");
    let ids = common::tokens(2, 16, config.vocab_size);
    let (_, outcomes) = common::run(&programs, &ids, 16, &SeededWeights::new(3));
    for (program, outcome) in programs.iter().zip(&outcomes) {
        assert_eq!(outcome.timings.len(), program.instructions.len(), "rank {}", outcome.rank);
        for (index, &(start, end)) in outcome.timings.iter().enumerate() {
            assert!(start <= end, "rank {} instruction {index} ends before it starts", outcome.rank);
        }
        // One thread runs a rank's instructions: each starts after the previous one ended.
        for pair in outcome.timings.windows(2) {
            assert!(pair[1].0 >= pair[0].1, "rank {}: {pair:?}", outcome.rank);
        }
    }
}

#[test]
fn scheduled_traces_overlap_transfers_with_kernels_and_blocking_ones_do_not() {
    let dir = tempdir("overlap");
    let path = |name: &str| dir.join(name).to_str().unwrap().to_string();
    let sizes = ["--batch", "2", "--seq", "32"];
    // Predicted: TP's all-reduces block the compute stream unless scheduled.
    let trace = |mesh: &str, out: &str, extra: &[&str]| {
        let mut args = vec!["trace", "tiny", "--mesh", mesh, "--hw", "cpu", "--out", out];
        args.extend(sizes);
        args.extend(extra);
        pleat(&args);
        let events = read(Path::new(out));
        check(&events, mesh.trim_start_matches(|c: char| !c.is_ascii_digit()).parse().unwrap());
        events
    };
    assert!(!some_rank_overlaps(&trace("tp=2", &path("tp-blocking.json"), &["--no-overlap"])));
    assert!(some_rank_overlaps(&trace("tsp=4", &path("tsp-predicted.json"), &[])));
    // Measured: over a slow emulated link the ring's next shard arrives while the current GEMM runs.
    let measured = path("tsp-measured.json");
    let mut args = vec!["run", "tiny", "--mesh", "tsp=4", "--emulate-link", "0.2,50", "--trace", &measured];
    args.extend(sizes);
    pleat(&args);
    let events = read(Path::new(&measured));
    check(&events, 4);
    assert!(some_rank_overlaps(&events), "the measured scheduled run overlaps nothing");
    let blocking = path("tp-measured-blocking.json");
    let mut args = vec!["run", "tiny", "--mesh", "tp=2", "--no-overlap", "--trace", &blocking];
    args.extend(sizes);
    pleat(&args);
    let events = read(Path::new(&blocking));
    check(&events, 2);
    assert!(!some_rank_overlaps(&events), "a blocking program's transfers run alone");
}

#[test]
fn a_training_step_traces_its_gradient_reductions_beside_the_backward() {
    let dir = tempdir("train");
    // `reduced`: how the trace names the gradients' all-reduces. (A gradient's all-reduce overlaps
    // the kernels that follow it until the backward waits on it: on 16 tokens a sequence those
    // last less than a busy machine takes to wake the comm thread, and the trace can show no
    // overlap, as it did 3 times in 40 beside four spinning threads on 2 cores; on 64 tokens, 8
    // sequences, none in 40.)
    let run = |out: &Path, extra: &[&str], reduced: &str| {
        let mut args = vec!["run", "tiny", "--train", "--steps", "1", "--mesh", "dp=2", "--batch", "8", "--seq", "64"];
        args.extend(["--emulate-link", "0.2,50", "--trace", out.to_str().unwrap()]);
        args.extend(extra);
        pleat(&args);
        let events = read(out);
        let tracks = check(&events, 2);
        for rank in 0..2 {
            let comm = names(&tracks, rank, 1);
            assert!(comm.iter().any(|name| name.starts_with(reduced)), "rank {rank}: {comm:?}");
        }
        events
    };
    let (alone, blocking) = (["--bucket-mb", "0"], ["--no-overlap", "--bucket-mb", "0"]);
    let scheduled = run(&dir.join("scheduled.json"), &alone, "all_reduce grad.");
    assert!(some_rank_overlaps(&scheduled), "gradients reduce beside the backward");
    assert!(!some_rank_overlaps(&run(&dir.join("blocking.json"), &blocking, "all_reduce grad.")));
    // tiny's gradients are 1.3 MB: a 1 MiB bucket fills before the backward ends, and the rest of
    // the backward runs beside it.
    let bucketed = run(&dir.join("bucketed.json"), &["--bucket-mb", "1"], "all_reduce bucket of ");
    assert!(some_rank_overlaps(&bucketed), "a full bucket reduces beside the rest of the backward");
}

#[test]
fn a_pipelined_steps_exposed_communication_is_at_most_its_communication() {
    // A later stage's first receive waits for the stage before to run its forward: that is the
    // pipeline's bubble, not communication, and the exposed seconds leave it out (they once
    // counted it: "exposed communication 150.2 us of 84.1 us").
    let dir = tempdir("pipelined-trace");
    let compiled = dir.join("compiled");
    let compiled = compiled.to_str().unwrap();
    pleat(&["compile", "tiny", "--mesh", "pp=2,dp=2", "--train", "--out", compiled]);
    let out = cli::stdout_of(&["trace", compiled, "--out", dir.join("t.json").to_str().unwrap()]);
    let line = out.lines().find(|line| line.starts_with("predicted step:")).expect("a predicted step");
    let figures: Vec<f64> =
        line.split(|c: char| !(c.is_ascii_digit() || c == '.')).filter_map(|word| word.parse().ok()).collect();
    let [_step, exposed, communication] = figures[..] else { panic!("{line}") };
    assert!(exposed > 0.0 && exposed <= communication, "{line}");
}

#[test]
fn tracing_a_compiled_directory_refuses_flags_that_contradict_its_plan() {
    // The directory's programs are what is traced: each flag was accepted and the tsp=2 plan
    // traced, as `pleat run DIR` refuses them.
    let dir = tempdir("trace-compiled-flags");
    let compiled = dir.join("tsp2");
    let compiled = compiled.to_str().expect("utf-8 path");
    stdout_of(&["compile", "tiny", "--mesh", "tsp=2", "--batch", "2", "--seq", "16", "--out", compiled]);
    let out = dir.join("trace.json");
    let out = out.to_str().expect("utf-8 path");
    for (flags, says) in [
        (&["--mesh", "tsp=4"][..], "--mesh tsp=4 differs from the compiled plan's tsp=2"),
        (&["--seq", "32"], "--seq 32 differs from the compiled plan's 16"),
        (&["--strategy", "tp"], "--strategy tp differs"),
        (&["--no-overlap"], "--no-overlap (every transfer blocking) differs"),
        (&["--comm-streams", "1"], "--comm-streams 1 differs"),
        (&["--micro-batches", "2"], "--micro-batches"),
    ] {
        let error = error_of(&[&["trace", compiled][..], flags, &["--out", out]].concat());
        assert!(error.starts_with("error[E07") && error.contains(says), "{flags:?}: {error}");
    }
    stdout_of(&["trace", compiled, "--mesh", "tsp=2", "--seq", "16", "--batch", "2", "--out", out]);
    // `pleat run DIR` ran --no-overlap as the directory's scheduled programs, without a word; a
    // directory compiled with --no-overlap takes the flag.
    let error = error_of(&["run", compiled, "--no-overlap"]);
    assert!(error.starts_with("error[E0707]: --no-overlap"), "{error}");
    let blocking = dir.join("blocking");
    let blocking = blocking.to_str().expect("utf-8 path");
    let args = ["compile", "tiny", "--mesh", "tsp=2", "--batch", "2", "--seq", "16", "--no-overlap", "--out", blocking];
    stdout_of(&args);
    stdout_of(&["trace", blocking, "--no-overlap", "--out", out]);
    stdout_of(&["run", blocking, "--no-overlap"]);
    // A training directory's pipeline flags are its plan's, as `run DIR --train` holds them.
    let training = dir.join("training");
    let training = training.to_str().expect("utf-8 path");
    let args = ["compile", "tiny", "--train", "--mesh", "pp=2", "--micro-batches", "2", "--batch", "2", "--seq", "16"];
    stdout_of(&[&args[..], &["--out", training]].concat());
    let error = error_of(&["trace", training, "--micro-batches", "4", "--out", out]);
    assert!(error.starts_with("error[E0793]") && error.contains("--micro-batches"), "{error}");
    stdout_of(&["trace", training, "--micro-batches", "2", "--out", out]);
}
