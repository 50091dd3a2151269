//! The `pleat` binary end to end: runs, compiled directories, and the messages bad input gets.

use std::path::Path;

#[path = "support/cli.rs"]
mod cli;
#[path = "support/trace.rs"]
mod trace_events;

use cli::{error_of, json_of, stdout_of, tempdir};

#[test]
fn the_demo_runs_the_programs_run_would_and_checks_them() {
    // `./dev demo` is one of the README's two commands. Its programs are scheduled for overlap as
    // `pleat run`'s are, so it reports the same peak as `run` on the same model and mesh (it ran
    // the unscheduled programs once: 1.06 MiB against run's 1.47 MiB).
    let demo = stdout_of(&["demo"]);
    assert!(demo.contains("checked against the reference interpreter") && demo.ends_with(": ok\n"), "{demo}");
    let peak = |text: &str, after: &str| -> String {
        let rest = &text[text.find(after).unwrap_or_else(|| panic!("{after:?} in {text}")) + after.len()..];
        rest.split_whitespace().take(2).collect::<Vec<_>>().join(" ").trim_end_matches(',').to_string()
    };
    let run = stdout_of(&["run", "tiny", "--mesh", "tp=4", "--batch", "8", "--seq", "64"]);
    assert_eq!(peak(&demo, "peak "), peak(&run, "peak bytes a rank: "), "demo:\n{demo}\nrun:\n{run}");
}

#[test]
fn run_reports_json_with_the_check() {
    let report =
        json_of(&["run", "tiny", "--mesh", "tp=4", "--batch", "2", "--seq", "16", "--check", "--format", "json"]);
    assert_eq!(report["ranks"], 4);
    assert_eq!(report["logits_shape"], serde_json::json!([2, 16, 256]));
    assert!(report["max_abs_err"].as_f64().expect("a number") < 1e-4);
    assert_eq!(report["peak_bytes_per_rank"].as_array().expect("array").len(), 4);
    assert!(report["comm_bytes"]["all_reduce"].as_u64().expect("bytes") > 0);
}

#[test]
fn bf16_inference_matches_the_reference_to_bf16_accuracy_with_half_the_bytes() {
    // `--precision bf16` stores weights and activations as bf16; the check holds the logits to
    // 2^-5 of the largest reference logit (`BF16_LOGITS_REL_TOL` says why).
    let run = |mesh: &str, precision: &str| {
        json_of(&[
            "run",
            "tiny",
            "--mesh",
            mesh,
            "--batch",
            "2",
            "--seq",
            "16",
            "--check",
            "--precision",
            precision,
            "--format",
            "json",
        ])
    };
    for mesh in ["tp=1", "tp=2", "tsp=2", "cp=2"] {
        let (f32_run, bf16_run) = (run(mesh, "f32"), run(mesh, "bf16"));
        let err = bf16_run["max_abs_err"].as_f64().expect("a number");
        let tolerance = bf16_run["tolerance"].as_f64().expect("a number");
        assert!(err <= tolerance, "{mesh}: {err:e} over {tolerance:e}");
        assert!(tolerance <= 0.2, "{mesh}: the logits of tiny are below 6.4, so the tolerance is below 0.2");
        assert!(err > 1e-3, "{mesh}: {err:e} is f32 noise, nothing was rounded to bf16");
        let peak = |report: &serde_json::Value| report["peak_bytes_per_rank"][0].as_f64().expect("bytes");
        let ratio = peak(&bf16_run) / peak(&f32_run);
        // Everything is bf16 but the token ids and positions (i32) and collective staging (f32).
        assert!((0.45..=0.6).contains(&ratio), "{mesh}: bf16 peak is {ratio:.3} of f32's");
    }
}

/// `--comm-streams 1` schedules for a runtime with one communication stream: the weight
/// broadcasts are prefetched on the one stream, none on a second, and the numbers are those of
/// the default schedule (two streams).
#[test]
fn one_communication_stream_puts_no_prefetch_on_a_second() {
    let dir = tempdir("comm-streams");
    let mut logits = Vec::new();
    for streams in ["2", "1"] {
        let out = dir.join(format!("tiny-tsp2-{streams}"));
        let out_str = out.to_str().expect("utf-8 path");
        stdout_of(&[
            "compile",
            "tiny",
            "--mesh",
            "tsp=2",
            "--batch",
            "2",
            "--seq",
            "16",
            "--comm-streams",
            streams,
            "--out",
            out_str,
        ]);
        let text = std::fs::read_to_string(out.join("rank0.txt")).expect("rank0.txt");
        let prefetches = text.lines().filter(|line| line.ends_with(" on prefetch")).count();
        let broadcasts = text.lines().filter(|line| line.contains("= broadcast(")).count();
        assert!(broadcasts > 0 && text.contains("wait("), "a scheduled TSP program: {text}");
        if streams == "2" {
            assert_eq!(prefetches, broadcasts, "every owner broadcast is prefetched on the second stream");
        } else {
            assert_eq!(prefetches, 0, "{text}");
        }
        let logits_out = dir.join(format!("logits-{streams}.safetensors"));
        stdout_of(&["run", out_str, "--logits-out", logits_out.to_str().unwrap()]);
        logits.push(std::fs::read(&logits_out).expect("logits written"));
    }
    assert_eq!(logits[0], logits[1], "the schedule changed the numbers");
}

#[test]
fn compiled_directory_runs_like_the_model() {
    let dir = tempdir("compiled");
    let out = dir.join("tiny-tp2");
    let out_str = out.to_str().expect("utf-8 path");
    stdout_of(&["compile", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--out", out_str]);
    for file in ["plan.json", "config.json", "module.pleat", "rank0.program", "rank1.txt"] {
        assert!(out.join(file).exists(), "{file} is missing");
    }
    let direct = dir.join("direct.safetensors");
    let compiled = dir.join("compiled.safetensors");
    stdout_of(&[
        "run",
        "tiny",
        "--mesh",
        "tp=2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--logits-out",
        direct.to_str().unwrap(),
    ]);
    stdout_of(&["run", out_str, "--check", "--logits-out", compiled.to_str().unwrap()]);
    assert_eq!(std::fs::read(direct).unwrap(), std::fs::read(compiled).unwrap(), "the same logits, bit for bit");
}

#[test]
fn compile_takes_the_precision_run_takes() {
    // `pleat run MODEL` runs in f32 unless --precision says otherwise, whatever the config's
    // torch_dtype; `pleat compile` did follow torch_dtype, so a bf16 config compiled to bf16
    // programs that `pleat run DIR` ran, unlike `pleat run MODEL`, and could not be told otherwise.
    // Both now take --precision alike: the same programs, the same logits bit for bit.
    let dir = tempdir("precision");
    let path = |name: &str| dir.join(name).to_str().expect("utf-8 path").to_string();
    let shape = ["--mesh", "tp=2", "--batch", "2", "--seq", "8"];
    let compile = |model: &str, out: &str, extra: &[&str]| {
        let mut args = vec!["compile", model, "--out", out];
        args.extend(shape);
        args.extend(extra);
        stdout_of(&args);
    };
    // A compiled directory runs its plan's mesh and shape; a model is given them.
    let logits = |model: &str, extra: &[&str], file: &str| {
        let mut args = vec!["run", model, "--check", "--format", "json", "--logits-out", file];
        if !Path::new(model).join("plan.json").exists() {
            args.extend(shape);
        }
        args.extend(extra);
        let report = json_of(&args);
        (std::fs::read(file).expect("logits written"), report["tolerance"].as_f64().expect("a tolerance"))
    };
    // tiny's config with torch_dtype bfloat16.
    compile("tiny", &path("f32"), &[]);
    let config = std::fs::read_to_string(dir.join("f32").join("config.json")).expect("config.json");
    assert!(config.contains("\"float32\""), "{config}");
    std::fs::write(dir.join("bf16.json"), config.replace("\"float32\"", "\"bfloat16\"")).expect("write");
    let bf16_config = path("bf16.json");
    compile(&bf16_config, &path("default"), &[]);
    let (direct, tolerance) = logits(&bf16_config, &[], &path("direct.safetensors"));
    let (compiled, compiled_tolerance) = logits(&path("default"), &[], &path("compiled.safetensors"));
    assert!(direct == compiled, "the config's torch_dtype does not change what either runs");
    assert_eq!((tolerance, compiled_tolerance), (f64::from(1e-4f32), f64::from(1e-4f32)), "f32's tolerance");
    compile("tiny", &path("bf16"), &["--precision", "bf16"]);
    let (direct, tolerance) = logits("tiny", &["--precision", "bf16"], &path("direct-bf16.safetensors"));
    let (compiled, compiled_tolerance) = logits(&path("bf16"), &[], &path("compiled-bf16.safetensors"));
    assert!(direct == compiled, "--precision bf16 compiles what it runs");
    assert!(tolerance > 1e-4 && tolerance == compiled_tolerance, "bf16's tolerance: {tolerance}, {compiled_tolerance}");
}

#[test]
fn outputs_never_replace_what_pleat_did_not_write() {
    let dir = tempdir("outputs");
    fn compile_into(out: &Path) -> Vec<String> {
        ["compile", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "8", "--out", out.to_str().unwrap()]
            .map(String::from)
            .to_vec()
    }
    fn args(owned: &[String]) -> Vec<&str> {
        owned.iter().map(String::as_str).collect()
    }
    // A directory of the user's own files, and a file: refused, both left as they were.
    let theirs = dir.join("theirs");
    std::fs::create_dir_all(&theirs).unwrap();
    std::fs::write(theirs.join("notes.txt"), "keep me").unwrap();
    let error = error_of(&args(&compile_into(&theirs)));
    assert!(error.contains("E0746") && error.contains("no plan.json"), "{error}");
    assert_eq!(std::fs::read_to_string(theirs.join("notes.txt")).unwrap(), "keep me");
    let file = dir.join("file.txt");
    std::fs::write(&file, "keep me too").unwrap();
    let error = error_of(&args(&compile_into(&file)));
    assert!(error.contains("E0746") && error.contains("is not a directory"), "{error}");
    assert_eq!(std::fs::read_to_string(&file).unwrap(), "keep me too");
    // An empty directory, and pleat's own output again: written.
    let empty = dir.join("empty");
    std::fs::create_dir_all(&empty).unwrap();
    stdout_of(&args(&compile_into(&empty)));
    stdout_of(&args(&compile_into(&empty)));
    assert!(empty.join("plan.json").exists());
    // A trace written through a link replaces what the link points to, not the link.
    let target = dir.join("target.json");
    std::fs::write(&target, "").unwrap();
    let link = dir.join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    stdout_of(&["trace", "tiny", "--mesh", "tp=2", "--batch", "2", "--seq", "8", "--out", link.to_str().unwrap()]);
    assert!(std::fs::symlink_metadata(&link).unwrap().file_type().is_symlink(), "the link was replaced");
    let trace: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&target).unwrap()).unwrap();
    assert!(trace["traceEvents"].as_array().is_some_and(|events| !events.is_empty()));
}

#[test]
fn runs_larger_than_the_machine_are_refused_before_they_allocate() {
    // No machine holds a trillion-row embedding, or 3 x 2^64 bytes of messages.
    let dir = tempdir("too-large");
    let tiny =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tiny/config.json")).unwrap();
    let mut config: serde_json::Value = serde_json::from_str(&tiny).unwrap();
    config["vocab_size"] = serde_json::json!(1_000_000_000_000u64);
    let path = dir.join("huge-vocab.json");
    std::fs::write(&path, config.to_string()).unwrap();
    for train in [false, true] {
        let mut args = vec!["run", path.to_str().unwrap(), "--mesh", "tp=2", "--batch", "2", "--seq", "8"];
        if train {
            args.push("--train");
        }
        let error = error_of(&args);
        assert!(error.contains("E0747") && error.contains("GB available"), "{error}");
    }
    // With a pp axis `pleat trace` runs one training step for real.
    let out = dir.join("trace.json");
    let error = error_of(&["trace", path.to_str().unwrap(), "--mesh", "pp=2", "--out", out.to_str().unwrap()]);
    assert!(error.contains("E0747") && error.contains("GB available"), "{error}");
    let error = error_of(&["bench", "comm", "--ranks", "2", "--sizes", "18446744073709551615B"]);
    assert!(error.contains("E0747"), "{error}");
    let error = error_of(&["bench", "comm", "--ranks", "2", "--sizes", "1KiB", "--iters", "0"]);
    assert!(error.contains("E0708") && error.contains("--iters"), "{error}");
}

#[test]
fn pipelines_default_to_micro_batches_that_split_the_batch() {
    // 2·pp = 4 micro-batches do not split a batch of 2: the default falls to 2.
    let dir = tempdir("default-micro-batches");
    let out = dir.join("trace.json");
    stdout_of(&["trace", "tiny", "--mesh", "pp=2", "--batch", "2", "--seq", "16", "--out", out.to_str().unwrap()]);
    assert!(out.exists());
    stdout_of(&["explain", "tiny", "--mesh", "pp=2", "--batch", "2", "--seq", "16"]);
}

#[test]
fn dump_after_prints_the_ir() {
    let dir = tempdir("dump");
    let text = stdout_of(&[
        "compile",
        "tiny",
        "--mesh",
        "tp=2",
        "--seq",
        "16",
        "--out",
        dir.join("o").to_str().unwrap(),
        "--dump-after",
        "propagate-specs",
    ]);
    assert!(text.contains("; after propagate-specs"));
    assert!(text.contains("all_reduce(") && text.contains("axis=tp"), "{text}");
}

#[test]
fn indivisible_degrees_name_the_dim_and_the_fix() {
    let message = error_of(&["run", "tiny", "--mesh", "tp=3"]);
    assert!(
        message.contains("8 heads are not divisible by tp=3; use tp in {1,2,4,8}"),
        "unexpected message: {message}"
    );
    let message = error_of(&["run", "tiny", "--mesh", "tsp=4", "--seq", "12"]);
    assert!(message.contains("seq=12 does not split into 2xtsp=8 zigzag chunks"), "{message}");
    let message = error_of(&["run", "tiny", "--mesh", "tsp=8"]);
    assert!(message.contains("4 kv heads are not divisible by tsp=8; use tsp in {1,2,4}"), "{message}");
    let message = error_of(&["run", "tiny", "--mesh", "dp=3", "--batch", "8"]);
    assert!(message.contains("8 sequences (batch) are not divisible by dp=3"), "{message}");
}

#[test]
fn bad_meshes_models_and_files_are_clear_errors() {
    assert!(error_of(&["run", "tiny", "--mesh", "tq=2"]).contains("unknown axis `tq`"));
    assert!(error_of(&["run", "tiny", "--mesh", "tp=two"]).contains("write axes as name=size"));
    assert!(error_of(&["run", "no-such-model"]).contains("is neither a preset"));
    assert!(
        error_of(&["run", "tiny", "--weights", "/nonexistent/w.safetensors"]).contains("/nonexistent/w.safetensors")
    );
    let dir = tempdir("bad-config");
    let config = dir.join("config.json");
    std::fs::write(&config, r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}"#).unwrap();
    let message = error_of(&["run", config.to_str().unwrap()]);
    assert!(message.contains("config.json: missing required field `vocab_size`"), "{message}");
    std::fs::write(&config, r#"{"architectures": ["GPT2LMHeadModel"]}"#).unwrap();
    assert!(error_of(&["run", config.to_str().unwrap()]).contains("GPT2LMHeadModel"));
    let tokens = dir.join("tokens.json");
    std::fs::write(&tokens, "[[1, 2, 3], [4, 5]]").unwrap();
    assert!(error_of(&["run", "tiny", "--tokens", tokens.to_str().unwrap()]).contains("sequence 1 has 2 tokens"));
}

#[test]
fn weights_that_do_not_fit_name_the_tensor() {
    // The llama-gqa fixture's weights (hidden 64) cannot serve the tiny model (hidden 128).
    let weights = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/hf/llama-gqa/model.safetensors");
    let message = error_of(&["run", "tiny", "--batch", "1", "--seq", "4", "--weights", weights.to_str().unwrap()]);
    assert!(message.contains("model.embed_tokens.weight"), "{message}");
}

#[test]
fn explain_gives_each_collective_its_reason() {
    let report = json_of(&["explain", "tiny", "--mesh", "tp=2", "--seq", "16", "--format", "json"]);
    let collectives = report["collectives"].as_array().expect("collectives");
    let o_proj =
        collectives.iter().find(|entry| entry["name"] == "layer0.o_proj.all_reduce").expect("o_proj's all-reduce");
    assert_eq!(o_proj["rule"], "partial-needs-all-reduce");
    assert!(o_proj["reason"].as_str().unwrap().contains("row-parallel matmul"));
    // 8 sequences x 16 tokens x 128 hidden x 4 bytes.
    assert_eq!(o_proj["bytes_per_rank"], 8 * 16 * 128 * 4);
    let values = report["values"].as_array().expect("values");
    let q = values.iter().find(|entry| entry["name"] == "layer0.q").expect("layer0.q");
    assert_eq!(q["spec"], "[batch, seq, heads/tp, head_dim]");

    let text = stdout_of(&["explain", "tiny", "--mesh", "tsp=2", "--seq", "16", "--value", "layer0.mlp_ring"]);
    assert!(text.contains("ring_gated_mlp over tsp") && text.contains("ring-weights-around-local-tokens"), "{text}");
    let dot =
        stdout_of(&["explain", "tiny", "--mesh", "tp=2", "--strategy", "tp-sp", "--seq", "16", "--format", "dot"]);
    assert!(dot.starts_with("digraph layer {") && dot.contains("reduce_scatter"), "{dot}");
    assert!(error_of(&["explain", "tiny", "--mesh", "tp=2", "--value", "layer0.nope"])
        .contains("no value named layer0.nope"));
}

#[test]
fn explain_counts_the_graphs_collectives_and_the_programs_transfers() {
    // tiny at tsp=2: a layer's graph has 8 weight broadcasts (q, k, v, o of two owners), 4 K/V
    // all-gathers and one MLP ring; the embedding's reduce-scatter and 2 gathers at the end make
    // 2·13 + 3 = 29. The programs pack an owner's four broadcasts into one message and run the
    // ring's one hop as a send and a receive: 2·(2 + 4 + 2) + 3 = 19 transfers a rank.
    let report = json_of(&["explain", "tiny", "--mesh", "tsp=2", "--seq", "16", "--batch", "2", "--format", "json"]);
    assert_eq!(report["collectives_per_step"], 29);
    assert_eq!(report["transfers_per_rank"], serde_json::json!([19, 19]));
    let text = stdout_of(&["explain", "tiny", "--mesh", "dp=2", "--seq", "16", "--batch", "2"]);
    assert!(text.contains("1 collective in a forward pass's graph (1 transfer a rank in the programs)"), "{text}");
}

#[test]
fn explain_shows_the_model_ends_gathers_and_a_rings_every_hop() {
    // Under SP the residual stream is gathered before the final norm for the LM head: named after
    // the last layer's output, it serves the model's end, and every layer's view shows it (it was
    // shown with --layer 1 only, and said the norm multiplies by a split weight).
    let args = ["explain", "tiny", "--mesh", "tp=2", "--strategy", "tp-sp", "--seq", "16", "--batch", "2"];
    let collectives = |layer: &str| -> Vec<serde_json::Value> {
        let report = json_of(&[&args[..], &["--layer", layer, "--format", "json"]].concat());
        report["collectives"].as_array().expect("collectives").clone()
    };
    let (first, last) = (collectives("0"), collectives("1"));
    assert_eq!(first.len(), last.len());
    let end = first.iter().find(|entry| entry["name"] == "layer1.mlp_residual.all_gather").expect("the end's gather");
    assert!(end["reason"].as_str().unwrap().contains("final_norm (rms_norm) runs on it whole and lm_head"), "{end}");
    // tsp=4: a rank sends its gate, up and down shards (3·128·256/4 f32) on 3 hops.
    let ring = json_of(&[
        "explain",
        "tiny",
        "--mesh",
        "tsp=4",
        "--seq",
        "16",
        "--value",
        "layer0.mlp_ring",
        "--format",
        "json",
    ]);
    let ring = &ring["collectives"][0];
    assert_eq!(ring["bytes_per_rank"], 3 * (3 * 128 * 256 / 4 * 4));
}

#[test]
fn explain_proof_names_the_rules_that_replace_the_o_proj_all_reduce() {
    let args = ["explain", "tiny", "--mesh", "tp=2", "--seq", "16", "--strategy", "tp-sp", "--proof"];
    let text = stdout_of(&[&args[..], &["layer0.attn_residual"]].concat());
    assert!(text.starts_with("layer0.attn_residual: "), "{text}");
    // The o_proj all-reduce becomes a reduce-scatter onto the residual's seq shard, and the layer
    // input is read as its shard (the stream stays split between layers).
    assert!(text.contains("partial-then-reduce-scatter: (local_slice tp seq (all_reduce tp (matmul"), "{text}");
    assert!(text.contains("slice-residual-to-meet-gather"), "{text}");
    assert!(text.contains("stream-is-the-gather-of-its-shard"), "{text}");
    let text = stdout_of(&["explain", "tiny", "--mesh", "tp=2", "--seq", "16", "--proof", "layer0.attn_residual"]);
    assert!(text.contains("no rule"), "plain tp keeps its all-reduce: {text}");
    assert!(
        error_of(&["explain", "tiny", "--mesh", "tp=2", "--proof", "layer0.nope"]).contains("no value `layer0.nope`")
    );
}

#[test]
fn a_gqa_config_with_more_ranks_than_kv_heads_checks() {
    let dir = tempdir("gqa");
    let config = dir.join("config.json");
    let text =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/tiny/config.json")).unwrap();
    let mut json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["num_key_value_heads"] = serde_json::json!(2);
    std::fs::write(&config, json.to_string()).unwrap();
    for tp in ["1", "2", "4"] {
        let mesh = format!("tp={tp}");
        let report = json_of(&[
            "run",
            config.to_str().unwrap(),
            "--mesh",
            &mesh,
            "--batch",
            "2",
            "--seq",
            "16",
            "--check",
            "--format",
            "json",
        ]);
        assert!(report["max_abs_err"].as_f64().expect("checked") < 1e-4, "{mesh}");
    }
}

fn plan_hash_of(stdout: &str) -> String {
    let hash = stdout.rsplit("plan hash ").next().expect("a plan hash").trim().to_string();
    assert!(hash.len() == 16 && hash.chars().all(|c| c.is_ascii_hexdigit()), "{stdout}");
    hash
}

#[test]
fn plans_are_deterministic_byte_for_byte_and_hashed() {
    let dir = tempdir("determinism");
    let compile = |mesh: &str, name: &str| {
        let out = dir.join(name);
        let stdout = stdout_of(&[
            "compile",
            "tiny",
            "--mesh",
            mesh,
            "--batch",
            "2",
            "--seq",
            "16",
            "--out",
            out.to_str().expect("utf-8"),
        ]);
        (out, plan_hash_of(&stdout))
    };
    let (first, first_hash) = compile("dp=2,tsp=2", "first");
    let (second, second_hash) = compile("dp=2,tsp=2", "second");
    assert_eq!(first_hash, second_hash);
    let mut files: Vec<_> =
        std::fs::read_dir(&first).expect("listing").map(|entry| entry.expect("entry").path()).collect();
    files.sort();
    assert_eq!(files.len(), 3 + 2 * 4, "plan, config, module and two files a rank");
    for file in files {
        let name = file.file_name().expect("a name");
        let twin = second.join(name);
        assert_eq!(std::fs::read(&file).expect("reads"), std::fs::read(&twin).expect("reads"), "{name:?} differs");
    }
    let plan: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(first.join("plan.json")).expect("plan.json")).expect("json");
    assert_eq!(plan["plan_hash"], first_hash.as_str());
    let (_, other_hash) = compile("tp=2,dp=2", "other");
    assert_ne!(other_hash, first_hash, "another mesh is another plan");

    let plan_args = ["plan", "llama3-8b", "--mesh", "tp=8", "--seq", "8192", "--format", "json"];
    let (one, two) = (json_of(&plan_args), json_of(&plan_args));
    assert_eq!(one, two);
    assert_eq!(one["plan_hash"].as_str().expect("a hash").len(), 16);
    let table = stdout_of(&["plan", "llama3-8b", "--mesh", "tp=8", "--seq", "8192"]);
    assert_eq!(plan_hash_of(&table), one["plan_hash"].as_str().expect("a hash"));
}

#[test]
fn emulated_links_keep_the_numbers_and_bad_links_are_refused() {
    let report = json_of(&[
        "run",
        "tiny",
        "--mesh",
        "tsp=2",
        "--batch",
        "1",
        "--seq",
        "16",
        "--emulate-link",
        "2,20",
        "--check",
        "--format",
        "json",
    ]);
    assert!(report["max_abs_err"].as_f64().expect("a number") < 1e-4);
    assert_eq!(report["emulated_link"], "2 GB/s, 20 µs");
    // A malformed flag value is a usage error (exit 2), reported by the argument parser.
    let output = cli::pleat(&["run", "tiny", "--mesh", "tp=2", "--emulate-link", "fast"]);
    assert_eq!(output.status.code(), Some(2));
    let message = String::from_utf8_lossy(&output.stderr);
    assert!(message.contains("\"fast\" is not a link: two numbers are needed; write GBPS,US"), "{message}");
}

#[test]
fn bench_overlap_runs_both_programs_and_finds_equal_logits() {
    let traces = tempdir("overlap-traces");
    let report = json_of(&[
        "bench",
        "overlap",
        "tiny",
        "--mesh",
        "tsp=2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--emulate-link",
        "1,10",
        "--repeats",
        "1",
        "--traces",
        traces.to_str().expect("utf-8 path"),
        "--format",
        "json",
    ]);
    assert_eq!(report["schema"], "pleat.bench.overlap/1");
    // Each program's measured and predicted traces: every rank's compute and comm slices.
    for file in ["blocking-measured", "blocking-predicted", "scheduled-measured", "scheduled-predicted"] {
        let events = trace_events::read(&traces.join(format!("{file}.json")));
        trace_events::assert_every_rank_has_both_tracks(&events, 2, file);
    }
    assert_eq!(report["same_logits"], true);
    let transfers = report["transfers"].as_u64().expect("a count");
    let overlapped = report["overlapped_transfers"].as_u64().expect("a count");
    assert!(transfers > 0 && overlapped > 0 && overlapped <= transfers, "{report}");
    for program in ["blocking", "scheduled"] {
        for field in ["step_s", "exposed_comm_s", "exposed_weights_s", "predicted_step_s"] {
            let value = report[program][field].as_f64().expect("seconds");
            assert!(value.is_finite() && value >= 0.0, "{program}.{field} = {value}");
        }
        // The weights' share of the exposed communication is part of it.
        assert!(report[program]["exposed_weights_s"].as_f64() <= report[program]["exposed_comm_s"].as_f64());
    }
}

#[test]
fn bench_buckets_sends_fewer_messages_for_the_same_losses() {
    let report = json_of(&[
        "bench",
        "buckets",
        "tiny",
        "--mesh",
        "dp=2",
        "--batch",
        "2",
        "--seq",
        "16",
        "--emulate-link",
        "1,10",
        "--repeats",
        "1",
        "--format",
        "json",
    ]);
    assert_eq!(report["schema"], "pleat.bench.buckets/1");
    assert_eq!(report["same_losses"], true);
    // tiny has 21 gradients and the loss, each all-reduced alone; 25 MiB holds the gradients. The
    // loss, one number, does not split into dp=2 equal chunks, so it is still reduced alone (in a
    // bucket the ring would add it in another order: see `pleat_backend::bucket`).
    assert_eq!(report["alone"]["reduction_messages"], 22, "{report}");
    assert_eq!(report["bucketed"]["reduction_messages"], 2, "{report}");
    for program in ["alone", "bucketed"] {
        let step = report[program]["step_s"].as_f64().expect("seconds");
        assert!(step.is_finite() && step > 0.0, "{program}: {step}");
    }
    // A bucket holds its gradients until the last one and packs them: more memory, never less.
    assert!(report["bucketed"]["planned_peak_bytes"].as_u64() > report["alone"]["planned_peak_bytes"].as_u64());
    let error = cli::error_of(&["bench", "buckets", "tiny", "--mesh", "tp=2", "--emulate-link", "1,10"]);
    assert!(error.contains("E0745") && error.contains("has no dp axis"), "{error}");
}

#[test]
fn every_json_document_carries_its_schema_version() {
    // DESIGN's contract: JSON output has a versioned schema. One document a command, and an error's.
    let commands: [&[&str]; 8] = [
        &["run", "tiny", "--mesh", "tp=2", "--seq", "8", "--batch", "2", "--format", "json"],
        &["run", "tiny", "--mesh", "dp=2", "--seq", "8", "--batch", "2", "--train", "--steps", "1", "--format", "json"],
        &["explain", "tiny", "--mesh", "tp=2", "--format", "json"],
        &["plan", "tiny", "--mesh", "tp=2", "--format", "json"],
        &["compare", "tiny", "--ranks", "2", "--format", "json"],
        &["search", "tiny", "--gpus", "2", "--format", "json"],
        &["schedule", "--pp", "2", "--micro-batches", "4", "--format", "json"],
        &["bench", "comm", "--ranks", "2", "--sizes", "1KiB", "--format", "json"],
    ];
    for args in commands {
        let document = json_of(args);
        match args[0] {
            // The benchmarks name their schema and its version.
            "bench" => assert_eq!(document["schema"], "pleat.bench.comm/1", "{args:?}"),
            _ => assert_eq!(document["schema_version"], 1, "{args:?}: {document}"),
        }
    }
    let output = cli::pleat(&["run", "tiny", "--mesh", "tp=3", "--format", "json"]);
    let error: serde_json::Value = serde_json::from_slice(&output.stderr).expect("the error as JSON on stderr");
    assert_eq!(error["schema_version"], 1, "{error}");
    assert_eq!(error["error"]["code"], "E0206");
}

#[test]
fn a_directory_compiled_from_a_model_directory_runs_on_its_weights() {
    // It ran on seeded weights (logits 5.9 off transformers') and --check passed, the reference
    // seeded alike. plan.json records the weights; gone, the run says so.
    let dir = tempdir("compiled-weights");
    let model = dir.join("model");
    std::fs::create_dir_all(&model).unwrap();
    for file in ["config.json", "model.safetensors", "tokens.json"] {
        std::fs::copy(Path::new("tests/fixtures/hf/llama-gqa").join(file), model.join(file)).unwrap();
    }
    let (model, compiled) = (model.to_str().unwrap(), dir.join("compiled"));
    let compiled = compiled.to_str().unwrap();
    let tokens = format!("{model}/tokens.json");
    stdout_of(&["compile", model, "--mesh", "tp=2", "--batch", "2", "--seq", "16", "--out", compiled]);
    let logits = |source: &str, extra: &[&str]| -> Vec<u8> {
        let out = dir.join(format!("{}.safetensors", extra.len()));
        let args = ["run", source, "--tokens", &tokens, "--logits-out", out.to_str().unwrap()];
        stdout_of(&[&args[..], extra].concat());
        std::fs::read(out).unwrap()
    };
    assert_eq!(logits(compiled, &[]), logits(model, &["--mesh", "tp=2"]), "the model's own weights");
    std::fs::rename(format!("{model}/model.safetensors"), dir.join("moved.safetensors")).unwrap();
    let error = error_of(&["run", compiled, "--tokens", &tokens]);
    assert!(error.starts_with("error[E0754]") && error.contains("model.safetensors, and they are gone"), "{error}");
    let moved = dir.join("moved.safetensors");
    stdout_of(&["run", compiled, "--tokens", &tokens, "--weights", moved.to_str().unwrap()]);
}

#[test]
fn weights_the_model_does_not_read_are_named() {
    // transformers warns of unused weights; pleat ran on without a word. Here the config ties the
    // embeddings, so the file's lm_head.weight is never loaded.
    let dir = tempdir("unused-weights");
    let fixture = Path::new("tests/fixtures/hf/llama-gqa");
    std::fs::copy(fixture.join("model.safetensors"), dir.join("model.safetensors")).unwrap();
    let mut config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixture.join("config.json")).unwrap()).unwrap();
    config["tie_word_embeddings"] = serde_json::Value::Bool(true);
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let output = cli::pleat(&["run", dir.to_str().unwrap(), "--batch", "2", "--seq", "16"]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    assert!(stderr.contains("holds 1 tensor(s) the model does not read (lm_head.weight)"), "{stderr}");
    // The fixture's own config reads every tensor: no warning.
    let output = cli::pleat(&["run", fixture.to_str().unwrap(), "--batch", "2", "--seq", "16"]);
    assert!(!String::from_utf8_lossy(&output.stderr).contains("warning"), "{output:?}");
}

#[test]
fn plan_json_fields_that_say_how_the_programs_run_are_in_the_plan_hash() {
    // An edited `training.zero` trained as "zero 1" programs compiled for none, and an edited
    // batch failed later as another error.
    let dir = tempdir("plan-fields");
    let out = dir.join("train");
    let out = out.to_str().unwrap();
    let args = ["compile", "tiny", "--train", "--mesh", "pp=2", "--micro-batches", "2", "--batch", "2", "--seq", "16"];
    stdout_of(&[&args[..], &["--out", out]].concat());
    let plan_path = Path::new(out).join("plan.json");
    let original = std::fs::read_to_string(&plan_path).unwrap();
    for (from, to) in
        [("\"zero\": 0", "\"zero\": 1"), ("\"batch\": 2", "\"batch\": 4"), ("\"bucket_mb\": 25", "\"bucket_mb\": 1")]
    {
        assert!(original.contains(from), "{from} in {original}");
        std::fs::write(&plan_path, original.replace(from, to)).unwrap();
        let error = error_of(&["run", out, "--train", "--steps", "1"]);
        assert!(error.starts_with("error[E0521]"), "{to}: {error}");
    }
    std::fs::write(&plan_path, &original).unwrap();
    stdout_of(&["run", out, "--train", "--steps", "1"]);
}
