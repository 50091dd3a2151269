//! Rank executables (`pleat compile --emit exe`): each rank's object linked with the static runtime
//! (`pleat-rt`), run by `pleat run DIR` as MPI processes. Their logits equal the bytecode path's bit
//! for bit and the reference's within tolerance; they send what the threads send; a rank started
//! in the wrong place, a rank that fails and a directory missing a rank are errors, never hangs.
#![cfg(all(feature = "llvm", feature = "mpi"))]

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

#[path = "support/cli.rs"]
mod cli;

use cli::{error_of, json_of, pleat, stdout_of, tempdir};

/// One MPI job at a time: the machine may have 2 cores.
static MPIRUN: Mutex<()> = Mutex::new(());

/// How long a failing job may take before the test calls it hung.
const FAULT_DEADLINE: Duration = Duration::from_secs(60);

fn one_job_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    MPIRUN.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn compile(dir: &Path, mesh: &str, emit: &[&str]) -> String {
    let out = dir.join(format!("{}-{}", mesh.replace([',', '='], "-"), emit.join("-")));
    let out = out.to_str().expect("utf-8 path").to_string();
    let mut args = vec!["compile", "tiny", "--mesh", mesh, "--batch", "2", "--seq", "16", "--out", &out];
    for kind in emit {
        args.extend(["--emit", kind]);
    }
    stdout_of(&args);
    out
}

/// Runs `ranks` rank executables of `dir` under mpirun, rank `i` with `args_of(i)`; waits at most
/// `FAULT_DEADLINE`, killing the job after it.
fn mpirun(dir: &str, ranks: &[u32], args_of: impl Fn(u32) -> Vec<String>) -> (Output, Duration) {
    let mut command = Command::new("mpirun");
    command.arg("--oversubscribe");
    for (position, &rank) in ranks.iter().enumerate() {
        if position > 0 {
            command.arg(":");
        }
        command.args(["-np", "1"]).arg(Path::new(dir).join(format!("rank{rank}"))).args(args_of(rank));
    }
    command
        .env("OMPI_ALLOW_RUN_AS_ROOT", "1")
        .env("OMPI_ALLOW_RUN_AS_ROOT_CONFIRM", "1")
        .env("OMPI_MCA_btl_vader_single_copy_mechanism", "none")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let start = Instant::now();
    let mut child = command.spawn().expect("mpirun runs (install openmpi-bin)");
    while child.try_wait().expect("waitable").is_none() {
        if start.elapsed() > FAULT_DEADLINE {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let elapsed = start.elapsed();
    (child.wait_with_output().expect("mpirun's output"), elapsed)
}

/// A tokens file of the plan's shape (batch 2, seq 16) in `dir`.
fn tokens_file(dir: &Path) -> String {
    let rows: Vec<Vec<u32>> = (0..2).map(|row| (0..16).map(|col| (row * 31 + col * 7) % 256).collect()).collect();
    let path = dir.join("tokens.json");
    std::fs::write(&path, serde_json::to_string(&rows).expect("json")).expect("tokens written");
    path.to_str().expect("utf-8 path").to_string()
}

/// A copy of the compiled directory `dir` with only the files `keep` accepts.
fn copy_keeping(dir: &str, suffix: &str, keep: impl Fn(&str) -> bool) -> String {
    let copy = format!("{dir}-{suffix}");
    std::fs::create_dir_all(&copy).expect("a directory");
    for entry in std::fs::read_dir(dir).expect("the compiled directory").flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        if keep(&name) {
            std::fs::copy(entry.path(), Path::new(&copy).join(&name)).expect("copied");
        }
    }
    copy
}

/// `pleat run DIR --format json`, its logits written; the report and the logits file's bytes.
fn run_json(dir: &str, check: bool) -> (serde_json::Value, Vec<u8>) {
    let logits = format!("{dir}.logits.safetensors");
    let mut args = vec!["run", dir, "--format", "json", "--logits-out", &logits];
    if check {
        args.push("--check");
    }
    let report = json_of(&args);
    (report, std::fs::read(&logits).expect("logits written"))
}

#[test]
fn rank_executables_match_the_bytecode_bit_for_bit_and_the_reference() {
    let _one = one_job_at_a_time();
    let dir = tempdir("exe-equivalence");
    for mesh in ["tp=2", "tsp=2", "dp=2,tp=2"] {
        // One compilation, three ways to run it: `--emit` reorders loads for fusion, so a directory
        // compiled without it would hold other programs.
        let compiled = compile(&dir, mesh, &["so", "exe"]);
        let is_executable = |name: &str| name.starts_with("rank") && !name.contains('.');
        let executables = copy_keeping(&compiled, "exe", |name| !name.ends_with(".so"));
        let libraries = copy_keeping(&compiled, "so", |name| !is_executable(name));
        let bytecode = copy_keeping(&compiled, "bytecode", |name| !is_executable(name) && !name.ends_with(".so"));
        let (report, native_logits) = run_json(&executables, true);
        let ranks = report["ranks"].as_u64().expect("ranks") as usize;
        assert_eq!(report["execution_per_rank"], serde_json::json!(vec!["native-executable"; ranks]), "{mesh}");
        let err = report["max_abs_err"].as_f64().expect("a number");
        assert!(err < 1e-4, "{mesh}: max abs err {err}");
        let (threads, library_logits) = run_json(&libraries, false);
        assert_eq!(threads["execution_per_rank"], serde_json::json!(vec!["native-entry"; ranks]), "{mesh}");
        assert_eq!(
            report["comm_bytes_per_rank"], threads["comm_bytes_per_rank"],
            "{mesh}: MPI sends what threads send"
        );
        assert_eq!(report["peak_bytes_per_rank"], threads["peak_bytes_per_rank"], "{mesh}: the same buffers live");
        assert!(native_logits == library_logits, "{mesh}: the executables' logits differ from the libraries'");
        let (interpreted, bytecode_logits) = run_json(&bytecode, false);
        assert_eq!(interpreted["execution_per_rank"], serde_json::json!(vec!["bytecode"; ranks]), "{mesh}");
        assert!(native_logits == bytecode_logits, "{mesh}: the executables' logits differ from the bytecode path's");
    }
}

#[test]
fn libraries_win_over_executables_and_a_missing_rank_is_refused() {
    let _one = one_job_at_a_time();
    let dir = tempdir("exe-choice");
    // With both, `run` takes the libraries (threads in this process).
    let both = compile(&dir, "tp=2", &["so", "exe"]);
    let ran = stdout_of(&["run", &both, "--check"]);
    assert!(ran.contains("execution a rank: native-entry, native-entry"), "{ran}");
    let only = compile(&dir, "tsp=2", &["exe"]);
    std::fs::remove_file(Path::new(&only).join("rank1")).expect("rank1 removed");
    let error = error_of(&["run", &only, "--check"]);
    assert!(error.contains("E0538") && error.contains("not rank1"), "{error}");
    let executables = compile(&dir, "tp=2", &["exe"]);
    let error = error_of(&["run", &executables, "--emulate-link", "10,5"]);
    assert!(error.contains("E0539") && error.contains("--emulate-link"), "{error}");
    // `launch` runs libraries as threads; it points at `run` for executables.
    let error = error_of(&["launch", &executables]);
    assert!(error.contains("E0528") && error.contains("`pleat run DIR` starts under mpirun"), "{error}");
}

#[test]
fn a_rank_in_the_wrong_place_or_failing_ends_the_job_with_its_reason() {
    let _one = one_job_at_a_time();
    let dir = tempdir("exe-faults");
    let compiled = compile(&dir, "tp=2", &["exe"]);
    let tokens = tokens_file(&dir);
    let out = dir.join("out");
    let args = |_: u32| {
        vec!["--tokens".to_string(), tokens.clone(), "--out".to_string(), out.to_str().expect("utf-8").to_string()]
    };
    // `--help` needs no MPI job.
    let help = Command::new(Path::new(&compiled).join("rank0")).arg("--help").output().expect("rank0 runs");
    assert!(help.status.success() && String::from_utf8_lossy(&help.stdout).contains("usage: rank<i> --tokens FILE"));
    // Started in order, the ranks run and each writes its outcome.
    let (output, _) = mpirun(&compiled, &[0, 1], args);
    assert!(output.status.success(), "{}", String::from_utf8_lossy(&output.stderr));
    for rank in 0..2 {
        assert!(out.join(format!("rank{rank}.outcome.safetensors")).is_file(), "rank {rank}'s outcome");
    }
    // Swapped, each refuses to run as the other. mpirun ends the job when the first one exits, so
    // the other's report may not be printed: either one names both ranks.
    let (output, elapsed) = mpirun(&compiled, &[1, 0], args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && elapsed < FAULT_DEADLINE, "swapped ranks ran or hung: {stderr}");
    assert!(
        stderr.contains("this executable is rank 1 of 2 but mpirun started it as rank 0 of 2")
            || stderr.contains("this executable is rank 0 of 2 but mpirun started it as rank 1 of 2"),
        "{stderr}"
    );
    // The same executable twice: the second refuses to run as rank 1, and ends the job, where the
    // first would wait for it in its first collective until its timeout.
    let (output, elapsed) = mpirun(&compiled, &[0, 0], args);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && elapsed < FAULT_DEADLINE, "a doubled rank ran or hung: {stderr}");
    assert!(
        stderr.contains("error[E0550]: rank0: this executable is rank 0 of 2 but mpirun started it as rank 1 of 2"),
        "{stderr}"
    );
    // Rank 1's weights lack every tensor: it fails at its first load, inside the job, and the job
    // ends with its reason while rank 0 waits in a collective.
    let weights = dir.join("empty.safetensors");
    pleat_runtime::weights::write_safetensors(&weights, &[("unrelated".to_string(), vec![1], vec![0.0])])
        .expect("weights written");
    let weights = weights.to_str().expect("utf-8").to_string();
    let (output, elapsed) = mpirun(&compiled, &[0, 1], |rank| {
        let mut args = args(rank);
        if rank == 1 {
            args.extend(["--weights".to_string(), weights.clone()]);
        }
        args
    });
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && elapsed < FAULT_DEADLINE, "a failed rank's job ran or hung: {stderr}");
    assert!(stderr.contains("rank 1 failed") && stderr.contains("embed"), "{stderr}");
}

#[test]
fn emit_exe_needs_the_static_runtime_and_says_where_it_looked() {
    let dir = tempdir("exe-no-runtime");
    let out = dir.join("d");
    let output = Command::new(env!("CARGO_BIN_EXE_pleat"))
        .args(["compile", "tiny", "--mesh", "tp=2", "--emit", "exe", "--out", out.to_str().expect("utf-8")])
        .env("PLEAT_RUNTIME_LIB", dir.join("libpleat_rt.a"))
        .env("NO_COLOR", "1")
        .output()
        .expect("pleat runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("E0537") && stderr.contains("cargo build --release -p pleat-rt"), "{stderr}");
    assert!(!out.exists(), "refused before anything was compiled");
    // The run-time side needs no runtime library: a plain run still works.
    assert!(pleat(&["run", "tiny", "--mesh", "tp=2", "--seq", "8", "--batch", "1"]).status.success());
}
