//! `pleat plan` and `pleat compare` end to end: JSON keys, the TSP/TP crossover, pipelines, hardware
//! files and the messages bad input gets.

#[path = "support/cli.rs"]
mod cli;

use cli::{error_of, json_of, pleat, stdout_of, tempdir};

#[test]
fn plan_json_has_the_documented_keys() {
    let plan = json_of(&["plan", "tsp-7b", "--mesh", "tsp=8", "--seq", "16384", "--hw", "mi300x", "--format", "json"]);
    for key in ["params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes", "transient_bytes", "peak_bytes"]
    {
        assert!(plan["memory"][key].as_f64().is_some_and(|bytes| bytes > 0.0), "memory.{key}");
    }
    for key in ["bytes_per_layer_fwd", "bytes_per_step"] {
        assert!(plan["comm"][key].as_f64().is_some_and(|bytes| bytes > 0.0), "comm.{key}");
    }
    for key in ["compute_s", "comm_s", "step_s"] {
        assert!(plan["time"][key].as_f64().is_some_and(|seconds| seconds > 0.0), "time.{key}");
    }
    assert!(plan["tokens_per_s"].as_f64().is_some_and(|rate| rate > 0.0));
    assert!(plan["mfu"].as_f64().is_some_and(|mfu| mfu > 0.0 && mfu < 1.0));
    assert_eq!(plan["schema_version"], 1);
    // The closed form of the forward volume: (D-1)/D·(16h² + 2BSh) elements, bf16.
    let h = 4096.0;
    let want = 7.0 / 8.0 * (16.0 * h * h + 2.0 * 16384.0 * h) * 2.0;
    let got = plan["comm"]["bytes_per_layer_fwd"].as_f64().unwrap();
    assert!((got - want).abs() < 1e-6 * want, "{got} vs {want}");
}

#[test]
fn plan_takes_the_strategy_run_takes() {
    // `--strategy tp-sp` is Megatron SP on the tp axis, as `--sequence-parallel` is: the norms'
    // and residuals' activations split over tp make the peak lower than tp's alone.
    let peak = |args: &[&str]| {
        let mut all = vec!["plan", "llama2-7b", "--mesh", "tp=8", "--seq", "8192", "--format", "json"];
        all.extend_from_slice(args);
        json_of(&all)["memory"]["peak_bytes"].as_f64().expect("a peak")
    };
    let (sp, flag, tp) = (peak(&["--strategy", "tp-sp"]), peak(&["--sequence-parallel"]), peak(&["--strategy", "tp"]));
    assert_eq!(sp, flag);
    assert!(sp < tp, "tp-sp {sp} vs tp {tp}");
    assert_eq!(tp, peak(&[]));
    // A strategy whose axis the mesh lacks is refused, as by run.
    let error = error_of(&["plan", "tiny", "--mesh", "dp=2", "--strategy", "tsp"]);
    assert!(error.contains("--strategy tsp needs the tsp axis in --mesh"), "{error}");
}

#[test]
fn plan_warns_when_the_peak_exceeds_the_device() {
    let output = pleat(&["plan", "llama3-70b", "--mesh", "tp=2", "--hw", "h100-sxm"]);
    assert!(output.status.success());
    let stderr = String::from_utf8(output.stderr).unwrap();
    assert!(stderr.contains("warning: peak memory"), "{stderr}");
    assert!(stderr.contains("exceeds the 85.5 GB of a h100-sxm"), "{stderr}");
    let fits = pleat(&["plan", "tiny", "--mesh", "tp=2", "--hw", "h100-sxm"]);
    assert!(String::from_utf8(fits.stderr).unwrap().is_empty());
}

#[test]
fn plan_of_405b_on_16384_ranks_answers_per_stage() {
    let plan = json_of(&[
        "plan",
        "llama3-405b",
        "--mesh",
        "dp=128,pp=16,tp=8",
        "--micro-batches",
        "32",
        "--recompute",
        "full",
        "--format",
        "json",
    ]);
    assert_eq!(plan["world_size"], 16384);
    let stages = plan["stages"].as_array().unwrap();
    assert_eq!(stages.len(), 16);
    // 1F1B: p micro-batches in flight on the first stage, one on the last.
    assert_eq!(stages[0]["in_flight"], 16.0);
    assert_eq!(stages[15]["in_flight"], 1.0);
    let layers: u64 = stages.iter().map(|stage| stage["layers"].as_u64().unwrap()).sum();
    assert_eq!(layers, 126);
    assert!(plan["time"]["bubble_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn compare_shows_the_tsp_crossover_at_8h_tokens() {
    let csv = stdout_of(&[
        "compare",
        "tsp-7b",
        "--ranks",
        "8",
        "--seq",
        "16384,32768,65536",
        "--hw",
        "mi300x",
        "--format",
        "csv",
    ]);
    let volume = |seq: &str, layout: &str| -> f64 {
        let line = csv
            .lines()
            .find(|line| line.starts_with(&format!("{seq},{layout},")))
            .unwrap_or_else(|| panic!("no row {seq} {layout} in\n{csv}"));
        line.split(',').nth(10).unwrap().parse().unwrap()
    };
    // h = 4096: 8h = 32768 tokens.
    assert!(volume("16384", "tsp=8") > volume("16384", "tp=8"));
    assert_eq!(volume("32768", "tsp=8"), volume("32768", "tp=8"));
    assert!(volume("65536", "tsp=8") < volume("65536", "tp=8"));
}

#[test]
fn compare_rows_are_sorted_by_peak_and_cover_the_splits() {
    let report = json_of(&[
        "compare",
        "tsp-7b",
        "--ranks",
        "8",
        "--seq",
        "131072",
        "--hw",
        "mi300x",
        "--recompute",
        "full",
        "--format",
        "json",
    ]);
    let rows = report["blocks"][0]["rows"].as_array().unwrap();
    let layouts: Vec<&str> = rows.iter().map(|row| row["layout"].as_str().unwrap()).collect();
    for layout in [
        "dp=8",
        "tp=8",
        "tp=8+sp",
        "cp=8",
        "tsp=8",
        "sp=2 x tp=4",
        "sp=4 x tp=2",
        "cp=2 x tp=4",
        "cp=4 x tp=2",
        "cp=2 x tp=4+sp",
        "cp=4 x tp=2+sp",
    ] {
        assert!(layouts.contains(&layout), "{layout} in {layouts:?}");
    }
    let peaks: Vec<f64> = rows.iter().map(|row| row["memory"]["peak_bytes"].as_f64().unwrap()).collect();
    assert!(peaks.windows(2).all(|pair| pair[0] <= pair[1]), "{peaks:?}");
    let position = |name: &str| layouts.iter().position(|layout| *layout == name).unwrap();
    assert!(position("tsp=8") < position("tp=8"));
    let table = stdout_of(&["compare", "tsp-7b", "--ranks", "8", "--seq", "4096,8192"]);
    assert_eq!(table.matches("tsp-7b on 8 ranks").count(), 2, "{table}");
    // One rank is one plan, one row (every axis of degree 1 gave the same row four times).
    let one = json_of(&["compare", "tiny", "--ranks", "1", "--seq", "64", "--format", "json"]);
    assert_eq!(one["blocks"][0]["rows"].as_array().unwrap().len(), 1, "{one}");
    // dp sends nothing in the forward: 0, not the "-0" of an empty f64 sum.
    let csv = stdout_of(&["compare", "tiny", "--ranks", "4", "--format", "csv"]);
    let dp = csv.lines().find(|line| line.contains(",dp=4,")).unwrap_or_else(|| panic!("{csv}"));
    assert_eq!(dp.split(',').nth(10), Some("0"), "{dp}");
    assert!(!csv.contains(",-0,"), "{csv}");
}

#[test]
fn hardware_files_override_the_table() {
    let dir = tempdir("cost-cli");
    let file = dir.join("tiny-gpu.toml");
    std::fs::write(
        &file,
        "name = \"tiny-gpu\"\nmemory_bytes = 1000000\npeak_bf16_flops = 1e12\npeak_f32_flops = 1e11\n\
         hbm_bytes_per_s = 1e11\ngpus_per_node = 8\n\
         intra_node = { bandwidth_bytes_per_s = 1e10, latency_s = 1e-6 }\n\
         inter_node = { bandwidth_bytes_per_s = 1e9, latency_s = 1e-5 }\n",
    )
    .unwrap();
    let path = file.to_str().unwrap();
    let plan = json_of(&["plan", "tiny", "--mesh", "tp=2", "--hw-file", path, "--format", "json"]);
    assert_eq!(plan["hardware"], "tiny-gpu");
    assert_eq!(plan["memory"]["device_bytes"], 1e6);
    std::fs::write(&file, "name = 1").unwrap();
    assert!(error_of(&["plan", "tiny", "--hw-file", path]).starts_with(&format!("error[E0245]: {path}: ")));
}

#[test]
fn bad_input_gets_a_clear_error() {
    // The first line: the code and message (help and location lines follow).
    let first_line = |args: &[&str]| error_of(args).lines().next().unwrap_or_default().to_string();
    assert_eq!(
        first_line(&["plan", "tsp-7b", "--mesh", "tp=3"]),
        "error[E0210]: 32 heads are not divisible by tp=3; use tp in {1,2,4,8,16,32}"
    );
    assert_eq!(
        first_line(&["plan", "tiny", "--mesh", "tq=2"]),
        "error[E0202]: mesh `tq=2`: unknown axis `tq`; axes are dp, tp, sp, cp, pp, tsp, ep"
    );
    assert_eq!(
        first_line(&["plan", "tiny", "--hw", "tpu"]),
        "error[E0244]: unknown hardware `tpu`; use one of h100-sxm, h200, a100-80gb, mi300x, cpu or --hw-file"
    );
    // 12 tokens take tsp in {1, 2, 3, 6}, tiny's heads and kv heads only 1 and 2 of them.
    assert_eq!(
        first_line(&["plan", "tiny", "--mesh", "tsp=4", "--seq", "12"]),
        "error[E0210]: 12 tokens (seq; zigzag needs 2·tsp chunks) are not divisible by tsp=4; use tsp in {1,2}"
    );
    assert_eq!(first_line(&["compare", "tiny", "--ranks", "0"]), "error[E0708]: --ranks 0: give at least 1 rank");
}

#[test]
fn calibrated_specs_drive_the_plan() {
    let dir = tempdir("calibrate");
    let file = dir.join("here.json");
    let path = file.to_str().unwrap();
    stdout_of(&["bench", "calibrate", "--quick", "--out", path]);
    let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    // What was measured is the peak, reached at efficiency 1.
    assert_eq!(spec["efficiency"]["matmul"], 1.0);
    assert_eq!(spec["peak_f32_flops"], spec["peak_bf16_flops"]);
    let plan = json_of(&["plan", "tiny", "--mesh", "tp=2", "--seq", "64", "--hw-file", path, "--format", "json"]);
    assert_eq!(plan["hardware"], "cpu-calibrated");
    assert_eq!(plan["memory"]["device_bytes"], spec["memory_bytes"].as_f64().unwrap());
    // The measured rates, not the nominal `cpu` entry's, set the predicted times.
    let nominal = json_of(&["plan", "tiny", "--mesh", "tp=2", "--seq", "64", "--hw", "cpu", "--format", "json"]);
    assert!(plan["time"]["compute_s"].as_f64().unwrap() > 0.0);
    assert_ne!(plan["time"]["compute_s"], nominal["time"]["compute_s"]);
    // In a pipe (as above) no bar; on a terminal (`script` gives the command a pseudo-terminal) a
    // bar counts the measurements, cleared for the report.
    let quiet = pleat(&["bench", "calibrate", "--quick", "--out", path]);
    assert!(!String::from_utf8_lossy(&quiet.stderr).contains("calibrating"));
    let (success, terminal) =
        cli::on_terminal(&format!("{} bench calibrate --quick --out {path}", env!("CARGO_BIN_EXE_pleat")));
    assert!(success, "{terminal}");
    assert!(terminal.contains("calibrating measurement"), "{terminal}");
    assert!(terminal.contains("wrote "), "the report follows: {terminal}");
}

#[test]
fn bench_alone_prints_the_figures_and_calibrate_as_a_flag_writes_the_spec() {
    // DESIGN.md §7's form: `pleat bench` prints this machine's figures, `--calibrate` writes them
    // as the spec `pleat bench calibrate` writes.
    let figures = stdout_of(&["bench", "--quick"]);
    for what in ["f32 GEMM", "attention", "streaming", "row-wise", "link bandwidth", "link latency"] {
        let line = figures.lines().find(|line| line.trim_start().starts_with(what)).unwrap_or_else(|| {
            panic!("no `{what}` line in:\n{figures}");
        });
        let figure: f64 = line[line.find(char::is_numeric).unwrap()..].split(' ').next().unwrap().parse().unwrap();
        assert!(figure > 0.0, "{line}");
    }
    let dir = tempdir("bench-calibrate-flag");
    let file = dir.join("here.json");
    let path = file.to_str().unwrap();
    stdout_of(&["bench", "--calibrate", "--quick", "--out", path]);
    let spec: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!((spec["name"].as_str(), spec["efficiency"]["matmul"].as_f64()), (Some("cpu-calibrated"), Some(1.0)));
    // --out without --calibrate, and the flag beside a subcommand, are usage errors.
    for (args, says) in [
        (&["bench", "--out", path][..], "required arguments were not provided:\n  --calibrate"),
        (&["bench", "--calibrate", "comm"][..], "the subcommand 'comm' cannot be used with '--calibrate'"),
    ] {
        let output = pleat(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{args:?}: {stderr}");
        assert!(stderr.contains(says), "{args:?}: {stderr}");
    }
}
