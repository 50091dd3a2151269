//! Multi-process runs: `mpirun -np 4 pleat rank DIR` against the reference and against the threads
//! communicator's byte counts (dense plans and a mixture of experts' token dispatch), the world-size
//! check, a rank that dies mid-step, and the MPI collective benchmark.
#![cfg(feature = "mpi")]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[path = "support/cli.rs"]
mod cli;
#[path = "support/trace.rs"]
mod trace_events;

use cli::{json_of, stdout_of, tempdir};
use trace_events::some_rank_overlaps;

/// One mpirun at a time: each starts 4 busy ranks, and the machine may have 2 cores.
static MPIRUN: Mutex<()> = Mutex::new(());

/// How long the fault test lets a job run before it calls it hung.
const FAULT_DEADLINE: Duration = Duration::from_secs(30);

fn mpirun_command(ranks: u32, args: &[&str]) -> Command {
    let mut command = Command::new("mpirun");
    command
        .args(["--allow-run-as-root", "--oversubscribe", "-np", &ranks.to_string()])
        .arg(env!("CARGO_BIN_EXE_pleat"))
        .args(args)
        .env("NO_COLOR", "1")
        // Containers often forbid the cross-process memory copy Open MPI's shared-memory transport
        // prefers; plain copies work everywhere and the tensors here are tiny.
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none");
    command
}

fn mpirun(ranks: u32, args: &[&str]) -> Output {
    let _one_at_a_time = MPIRUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    mpirun_command(ranks, args).output().expect("mpirun runs (install openmpi-bin)")
}

#[test]
fn run_comm_mpi_starts_the_job_itself_and_matches_the_threads() {
    // `pleat run --comm mpi` compiles, starts mpirun over `pleat rank` itself and prints rank 0's
    // report: the logits, the peaks and the bytes sent are the threads run's.
    let dir = tempdir("run-comm-mpi");
    for mesh in ["tp=2", "dp=2,tsp=2"] {
        let logits = |comm: &str| dir.join(format!("{}-{comm}.safetensors", mesh.replace([',', '='], "-")));
        let run = |comm: &str| {
            let out = logits(comm);
            let out = out.to_str().expect("utf-8 path").to_string();
            let args = ["run", "tiny", "--mesh", mesh, "--seq", "16", "--batch", "2", "--check", "--format", "json"];
            let mut args: Vec<&str> = args.to_vec();
            args.extend(["--comm", comm, "--logits-out", &out]);
            let _one_at_a_time = MPIRUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
            json_of(&args)
        };
        let (mpi, threads) = (run("mpi"), run("threads"));
        assert_eq!((&mpi["comm"], &threads["comm"]), (&"mpi".into(), &"threads".into()), "{mesh}");
        assert_eq!(mpi["schema_version"], 1, "{mesh}");
        assert!(mpi["max_abs_err"].as_f64().is_some_and(|err| err < 1e-4), "{mesh}: {mpi}");
        // The same report, key for key (it lacked the parameters', each rank's bytes, the
        // tolerance and the execution paths).
        let keys =
            |report: &serde_json::Value| report.as_object().expect("an object").keys().cloned().collect::<Vec<_>>();
        assert_eq!(keys(&mpi), keys(&threads), "{mesh}");
        for key in keys(&threads).iter().filter(|key| *key != "comm") {
            assert_eq!(mpi[key], threads[key], "{mesh}: {key}");
        }
        let (mpi_logits, threads_logits) = (std::fs::read(logits("mpi")), std::fs::read(logits("threads")));
        assert_eq!(mpi_logits.expect("mpi logits"), threads_logits.expect("threads logits"), "{mesh}: logits");
    }
    // `pleat rank` runs a forward pass; training stays on threads.
    let error = cli::error_of(&["run", "tiny", "--mesh", "tp=2", "--comm", "mpi", "--train"]);
    assert!(error.contains("takes no --train"), "{error}");
}

fn compile_tiny(dir: &Path, mesh: &str) -> String {
    let out = dir.join(mesh.replace([',', '='], "-"));
    let out = out.to_str().expect("utf-8 path").to_string();
    stdout_of(&["compile", "tiny", "--mesh", mesh, "--batch", "2", "--seq", "16", "--out", &out]);
    out
}

#[test]
fn mpi_ranks_match_the_reference_and_the_threads_byte_counts() {
    let dir = tempdir("mpi-equivalence");
    for mesh in ["tp=4", "tsp=4", "dp=2,tsp=2"] {
        let compiled = compile_tiny(&dir, mesh);
        let output = mpirun(4, &["rank", &compiled, "--check", "--format", "json"]);
        let stdout = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success(),
            "{mesh}: mpirun failed\nstdout:\n{stdout}\nstderr:\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        let report: serde_json::Value = serde_json::from_str(&stdout).expect("rank 0 prints one JSON report");
        assert_eq!(report["ranks"], 4, "{mesh}");
        assert_eq!(report["schema_version"], 1, "{mesh}");
        assert_eq!(report["logits_shape"], serde_json::json!([2, 16, 256]), "{mesh}");
        let err = report["max_abs_err"].as_f64().expect("a number");
        assert!(err < 1e-4, "{mesh}: max abs err {err}");
        let threads = json_of(&["run", &compiled, "--check", "--format", "json"]);
        assert_eq!(report["comm_bytes"], threads["comm_bytes"], "{mesh}: MPI sends what the threads fabric sends");
        // The report of `pleat run DIR`, key for key (a directory's native kernels were [0, 0]
        // on threads and [] under MPI).
        for (key, value) in threads.as_object().expect("an object") {
            if key != "comm" {
                assert_eq!(&report[key], value, "{mesh}: {key}");
            }
        }
    }
}

#[test]
fn mpi_ranks_send_tokens_to_their_experts_as_threads_do() {
    // The all-to-all dispatcher's messages are sized by the routing (counts exchanged first).
    let dir = tempdir("mpi-experts");
    let out = dir.join("tiny-moe-ep4");
    let out = out.to_str().expect("utf-8 path");
    stdout_of(&["compile", "tiny-moe", "--mesh", "dp=2,ep=2", "--batch", "4", "--seq", "16", "--out", out]);
    let output = mpirun(4, &["rank", out, "--check", "--format", "json"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "mpirun failed\nstdout:\n{stdout}\nstderr:\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&stdout).expect("rank 0 prints one JSON report");
    let err = report["max_abs_err"].as_f64().expect("a number");
    assert!(err < 1e-4, "max abs err {err}");
    let threads = json_of(&["run", out, "--format", "json"]);
    assert_eq!(report["comm_bytes"], threads["comm_bytes"], "MPI sends what the threads fabric sends");
}

/// A scheduled program's transfers run on each process's communication threads, the progress
/// threads MPI needs, beside its kernels: its measured trace shows a transfer in flight while a
/// kernel runs, with bitwise the logits of the threads runtime. Scheduled for two streams (the
/// default), each process prefetches the owners' weights on a second thread of its own over a
/// second communicator, as the threads runtime does; for one (`--comm-streams 1`), on the one
/// stream. A blocking program's transfers run alone.
#[test]
fn scheduled_programs_overlap_transfers_with_kernels_under_mpi() {
    let dir = tempdir("mpi-overlap");
    // (name, compile flags, some transfer beside a kernel, prefetches on a track of their own)
    let runs: [(&str, &[&str], bool, bool); 3] = [
        ("scheduled", &[], true, true),
        ("one-stream", &["--comm-streams", "1"], true, false),
        ("blocking", &["--no-overlap"], false, false),
    ];
    for (name, extra, overlaps, prefetch_track) in runs {
        let out = dir.join(format!("tsp4-{name}"));
        let out = out.to_str().expect("utf-8 path");
        let mut args = vec!["compile", "tiny", "--mesh", "tsp=4", "--batch", "2", "--seq", "32", "--out", out];
        args.extend_from_slice(extra);
        stdout_of(&args);
        let trace = dir.join(format!("{name}.json"));
        let trace = trace.to_str().expect("utf-8 path");
        let mpi_logits = dir.join(format!("{name}-mpi.safetensors"));
        let mpi_logits = mpi_logits.to_str().expect("utf-8 path");
        let output = mpirun(4, &["rank", out, "--check", "--trace", trace, "--logits-out", mpi_logits]);
        assert!(
            output.status.success(),
            "{name}: mpirun failed\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        let events = trace_events::read(Path::new(trace));
        trace_events::assert_every_rank_has_both_tracks(&events, 4, name);
        assert_eq!(some_rank_overlaps(&events), overlaps, "{name}");
        for rank in 0..4u64 {
            let prefetches = events.iter().any(|event| event["ph"] == "X" && event["pid"] == rank && event["tid"] == 2);
            assert_eq!(prefetches, prefetch_track, "{name}: rank {rank} has a prefetch track");
        }
        let threads_logits = dir.join(format!("{name}-threads.safetensors"));
        let threads_logits = threads_logits.to_str().expect("utf-8 path");
        stdout_of(&["run", out, "--logits-out", threads_logits]);
        let read = |path: &str| std::fs::read(path).expect("logits written");
        assert!(read(mpi_logits) == read(threads_logits), "{name}: MPI's logits differ from the threads runtime's");
    }
}

#[test]
fn a_world_of_the_wrong_size_is_rejected_with_both_numbers() {
    let dir = tempdir("mpi-world-size");
    let compiled = compile_tiny(&dir, "tp=2");
    let output = mpirun(4, &["rank", &compiled]);
    assert!(!output.status.success(), "a 4-rank world cannot run a 2-rank plan");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("the MPI world has 4 ranks"), "{stderr}");
    assert!(stderr.contains("compiled for 2 ranks"), "{stderr}");
    assert!(stderr.contains("mpirun -np 2"), "{stderr}");
}

/// Rank 2 exits abruptly at its second communication call, in the middle of the forward pass; the
/// job must end on its own, fail, and say which rank died.
#[test]
fn a_rank_that_dies_mid_step_ends_the_job_naming_it() {
    let dir = tempdir("mpi-fault");
    let compiled = compile_tiny(&dir, "tp=4");
    let _one_at_a_time = MPIRUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let mut child = mpirun_command(4, &["rank", &compiled, "--timeout", "10"])
        .env("PLEAT_TEST_EXIT_AT_COMM", "2:1")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("mpirun runs");
    let started = Instant::now();
    let status = loop {
        if let Some(status) = child.try_wait().expect("the job's status") {
            break status;
        }
        if started.elapsed() > FAULT_DEADLINE {
            let _ = child.kill();
            let output = child.wait_with_output().expect("the job's output");
            panic!(
                "the job still ran after {FAULT_DEADLINE:?}\nstdout:\n{}\nstderr:\n{}",
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let output = child.wait_with_output().expect("the job's output");
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(!status.success(), "a job with a dead rank fails\n{text}");
    assert!(mentions_dead_rank(&text, 2), "the output names rank 2\n{text}");
}

/// Rank 1 cannot read its tokens file (a file one host lacks, say) and fails before its first
/// message: it must end the job with its own error, not leave rank 0 waiting out its timeout and
/// itself blocked in `MPI_Finalize` with its error unprinted.
#[test]
fn a_rank_that_fails_before_its_first_message_ends_the_job_with_its_error() {
    let dir = tempdir("mpi-early-fault");
    let compiled = compile_tiny(&dir, "tp=2");
    let missing = dir.join("missing-tokens.json");
    let missing = missing.to_str().expect("utf-8 path");
    let pleat = env!("CARGO_BIN_EXE_pleat");
    let _one_at_a_time = MPIRUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let output = Command::new("mpirun")
        .args(["--allow-run-as-root", "--oversubscribe", "-np", "1", pleat, "rank", &compiled, "--timeout", "20"])
        .args([":", "-np", "1", pleat, "rank", &compiled, "--timeout", "20", "--tokens", missing])
        .env("NO_COLOR", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .output()
        .expect("mpirun runs");
    let text = format!("{}{}", String::from_utf8_lossy(&output.stdout), String::from_utf8_lossy(&output.stderr));
    assert!(!output.status.success(), "{text}");
    assert!(text.contains("error[E0743]: rank 1 cannot start") && text.contains("missing-tokens.json"), "{text}");
    assert!(!text.contains("timed out"), "rank 0 waited out its timeout\n{text}");
}

/// The memory check of a threads run holds under MPI too: the job would abort in the allocator.
#[test]
fn mpi_runs_check_memory_before_they_allocate() {
    let _one_at_a_time = MPIRUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
    let error = cli::error_of(&["run", "tiny", "--batch", "1", "--seq", "4294967295", "--comm", "mpi"]);
    assert!(error.starts_with("error[E0747]: running 1 ranks' programs needs"), "{error}");
    drop(_one_at_a_time);
    let output = mpirun(2, &["bench", "comm", "--comm", "mpi", "--sizes", "18446744073709551615B"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("error[E0747]: --sizes up to"), "{stderr}");
    let output = mpirun(2, &["bench", "comm", "--comm", "mpi", "--ranks", "0"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("error[E0708]: --ranks 0"), "{stderr}");
}

/// `pleat rank DIR` loads the weights `plan.json` records, as `pleat run DIR` does (it ran on
/// seeded weights, and `--check` passed against a reference seeded alike).
#[test]
fn mpi_ranks_load_the_weights_the_directory_was_compiled_beside() {
    let dir = tempdir("mpi-weights");
    let checkpoint = dir.join("checkpoint");
    let checkpoint = checkpoint.to_str().expect("utf-8 path");
    stdout_of(&["run", "tiny", "--train", "--steps", "1", "--batch", "2", "--seq", "16", "--save", checkpoint]);
    let compiled = dir.join("compiled");
    let compiled = compiled.to_str().expect("utf-8 path");
    stdout_of(&["compile", checkpoint, "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--out", compiled]);
    let (from_rank, from_run, seeded) =
        (dir.join("rank.safetensors"), dir.join("run.safetensors"), dir.join("seeded.safetensors"));
    let output = mpirun(2, &["rank", compiled, "--check", "--logits-out", from_rank.to_str().expect("utf-8")]);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    stdout_of(&["run", compiled, "--logits-out", from_run.to_str().expect("utf-8")]);
    let seeded_args = ["run", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--logits-out"];
    stdout_of(&[&seeded_args[..], &[seeded.to_str().expect("utf-8")]].concat());
    let read = |path: &Path| std::fs::read(path).expect("logits");
    assert_eq!(read(&from_rank), read(&from_run), "pleat rank and pleat run load the same weights");
    assert_ne!(read(&from_rank), read(&seeded), "the trained weights, not the seeded ones");
}

/// Whether mpirun's report (or a surviving rank's error) names `rank` as the one that failed.
fn mentions_dead_rank(text: &str, rank: u32) -> bool {
    // Open MPI names a process `[[job,1],rank]` and gives its exit code; pleat's own errors say
    // `because rank N failed`.
    (text.contains(&format!(",1],{rank}]")) && text.contains("Exit code:    3"))
        || text.contains(&format!("because rank {rank} failed"))
}

#[test]
fn the_mpi_benchmark_checks_results_and_sends_what_threads_send() {
    let output =
        mpirun(4, &["bench", "comm", "--comm", "mpi", "--sizes", "1KiB..16KiB", "--iters", "2", "--format", "json"]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "stdout:\n{stdout}\nstderr:\n{}", String::from_utf8_lossy(&output.stderr));
    let mpi: serde_json::Value = serde_json::from_str(&stdout).expect("rank 0 prints one JSON report");
    let threads =
        json_of(&["bench", "comm", "--ranks", "4", "--sizes", "1KiB..16KiB", "--iters", "2", "--format", "json"]);
    assert_eq!(mpi["schema"], "pleat.bench.comm/1");
    let rows = |report: &serde_json::Value| -> Vec<(String, u64, u64)> {
        report["results"]
            .as_array()
            .expect("results")
            .iter()
            .map(|row| {
                let busbw = row["busbw_gbps"].as_f64().expect("busbw");
                assert!(busbw.is_finite() && busbw > 0.0, "{row}");
                (
                    row["op"].as_str().expect("op").to_string(),
                    row["bytes"].as_u64().unwrap(),
                    row["bytes_sent_rank0"].as_u64().unwrap(),
                )
            })
            .collect()
    };
    let mpi_rows = rows(&mpi);
    assert_eq!(mpi_rows.len(), 5 * 3, "5 sizes x 3 collectives");
    assert_eq!(mpi_rows, rows(&threads));
}
