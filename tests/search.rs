//! `pleat search` end to end: the TSP paper's setting ranks TSP first on memory at 128K tokens and
//! TP first on time at 4K, each with its reason; the winner agrees with `pleat plan`; every plan it
//! lists compiles for a small stand-in of the same shape; bad input gets a clear error.

#[path = "support/cli.rs"]
mod cli;

use cli::{error_of, json_of, stdout_of, tempdir};

fn search_json(seq: &str) -> serde_json::Value {
    json_of(&["search", "tsp-7b", "--gpus", "8", "--hw", "mi300x", "--seq", seq, "--format", "json"])
}

#[test]
fn tsp_leads_on_memory_at_128k_and_tp_on_time_at_4k() {
    let long = search_json("131072");
    assert_eq!(long["single_axis_by_memory"][0]["layout"], "tsp=8", "{:#}", long["single_axis_by_memory"]);
    let why = long["tsp_vs_tp"].as_str().expect("a reason");
    assert!(why.starts_with("tsp=8 ") && why.contains("the largest difference is communication"), "{why}");

    let short = search_json("4096");
    let why = short["tsp_vs_tp"].as_str().expect("a reason");
    assert!(why.starts_with("tp=8") && why.contains("the largest difference is communication"), "{why}");
    let table = stdout_of(&["search", "tsp-7b", "--gpus", "8", "--hw", "mi300x", "--seq", "4096", "--explain"]);
    assert!(table.contains("why first: ") && table.contains("tsp against tp: tp=8"), "{table}");
}

#[test]
fn the_winner_is_what_pleat_plan_predicts() {
    let found = search_json("16384");
    let winner = &found["plans"][0];
    let strategy_flag = winner["layout"].as_str().expect("layout").contains("+sp");
    let (batch, micro_batches) = (winner["micro_batch"].to_string(), winner["micro_batches"].to_string());
    let zero = winner["zero"].to_string();
    let mut args = vec![
        "plan",
        "tsp-7b",
        "--mesh",
        winner["mesh"].as_str().expect("mesh"),
        "--hw",
        "mi300x",
        "--seq",
        "16384",
        "--batch",
        &batch,
        "--micro-batches",
        &micro_batches,
        "--zero",
        &zero,
        "--recompute",
        winner["recompute"].as_str().expect("recompute"),
        "--tsp-shard-embeddings",
        "--format",
        "json",
    ];
    if strategy_flag {
        args.push("--sequence-parallel");
    }
    let plan = json_of(&args);
    assert_eq!(plan["time"]["step_s"], winner["step_s"]);
    assert_eq!(plan["memory"]["peak_bytes"], winner["peak_bytes"]);
}

/// A small model with the heads of `tsp-7b` (32 query and 32 kv heads), so that every mesh the
/// search proposes for it divides the same way.
const STAND_IN: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
  "hidden_size": 128, "head_dim": 4, "intermediate_size": 256, "num_attention_heads": 32,
  "num_key_value_heads": 32, "num_hidden_layers": 1, "vocab_size": 256, "rms_norm_eps": 1e-5,
  "rope_theta": 10000.0, "tie_word_embeddings": false, "torch_dtype": "float32"
}"#;

#[test]
fn every_listed_plan_compiles_for_a_stand_in() {
    let dir = tempdir("search-compiles");
    let stand_in = dir.join("stand-in.json");
    std::fs::write(&stand_in, STAND_IN).expect("writes");
    let stand_in = stand_in.to_str().expect("utf-8");
    for seq in ["131072", "4096"] {
        for plan in search_json(seq)["plans"].as_array().expect("plans") {
            let mesh = plan["mesh"].as_str().expect("mesh");
            let strategy = if plan["layout"].as_str().expect("layout").contains("+sp") { "tp-sp" } else { "auto" };
            let dp: u64 = mesh.split(',').find_map(|axis| axis.strip_prefix("dp=")).map_or(1, |d| d.parse().unwrap());
            let batch = (plan["micro_batch"].as_u64().expect("b") * dp).to_string();
            let out = dir.join("compiled");
            stdout_of(&[
                "compile",
                stand_in,
                "--mesh",
                mesh,
                "--strategy",
                strategy,
                "--seq",
                "64",
                "--batch",
                &batch,
                "--out",
                out.to_str().expect("utf-8"),
            ]);
        }
    }
    let plan_file = dir.join("plan.json");
    let plan_path = plan_file.to_str().expect("utf-8");
    stdout_of(&["search", "tsp-7b", "--gpus", "8", "--hw", "mi300x", "--seq", "4096", "--emit-plan", plan_path]);
    let out = dir.join("from-plan");
    let compiled = stdout_of(&["compile", stand_in, "--plan", plan_path, "--out", out.to_str().expect("utf-8")]);
    let chosen: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan_file).expect("reads")).expect("json");
    assert!(compiled.contains(&format!("for {}", chosen["mesh"].as_str().expect("mesh"))), "{compiled}");
}

#[test]
fn a_searched_plan_compiles_into_the_training_step_it_chose() {
    // With --train, `compile --plan` takes the plan's micro-batches, ZeRO stage and recomputation,
    // and the batch of every micro-batch; the directory trains, checked.
    let dir = tempdir("search-train");
    let plan_file = dir.join("plan.json");
    let plan_path = plan_file.to_str().expect("utf-8");
    let search = ["search", "tiny", "--gpus", "4", "--seq", "64", "--global-batch", "8", "--hw", "cpu"];
    stdout_of(&[&search[..], &["--emit-plan", plan_path]].concat());
    let chosen: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&plan_file).expect("reads")).expect("json");
    let out = dir.join("compiled");
    let out = out.to_str().expect("utf-8");
    stdout_of(&["compile", "tiny", "--plan", plan_path, "--train", "--out", out]);
    let compiled: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(std::path::Path::new(out).join("plan.json")).expect("reads"))
            .expect("json");
    let count = |key: &str| chosen[key].as_u64().expect(key);
    assert_eq!(compiled["batch"].as_u64(), Some(count("micro_batch") * count("dp") * count("micro_batches")));
    assert_eq!(compiled["mesh"], chosen["mesh"]);
    for key in ["micro_batches", "zero", "recompute"] {
        assert_eq!(compiled["training"][key], chosen[key], "{key}");
    }
    let trained = json_of(&["run", out, "--train", "--steps", "1", "--check", "--format", "json"]);
    cli::assert_matches_reference(&trained, "the searched plan");
    // Flags the plan sets are refused beside it.
    let output = cli::pleat(&["compile", "tiny", "--plan", plan_path, "--train", "--zero", "1", "--out", out]);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success() && stderr.contains("cannot be used with"), "{stderr}");
}

#[test]
fn bad_searches_are_clear_errors() {
    let message = error_of(&["search", "tsp-7b", "--gpus", "8", "--mem-cap", "0.001"]);
    assert!(message.contains("no plan of 8 GPUs fits in 0.0 GB a GPU"), "{message}");
    // Where no layout divides, raising the cap cannot help: the error says what does.
    let message = error_of(&["search", "tiny", "--gpus", "1024", "--global-batch", "1", "--seq", "16"]);
    assert!(message.starts_with("error[E0236]: no layout of 1024 GPUs divides the model and the batch"), "{message}");
    let message = error_of(&["search", "tsp-7b", "--gpus", "0"]);
    assert!(message.contains("--gpus 0: give at least 1"), "{message}");
    let dir = tempdir("search-errors");
    let plan = dir.join("plan.json");
    let message = error_of(&[
        "search",
        "llama3-405b",
        "--gpus",
        "16384",
        "--seq",
        "8192",
        "--global-batch",
        "2048",
        "--all-axes",
        "--emit-plan",
        plan.to_str().expect("utf-8"),
    ]);
    assert!(message.contains("uses an axis pleat cannot compile yet; drop --all-axes"), "{message}");
    assert!(!plan.exists());
}

#[test]
fn a_training_search_proposes_pipelines_that_compile_and_train() {
    // pp pipelines training steps, which pleat compiles: a training search costs it (not "model
    // only"), and its plan trains as the reference does; a forward-pass search leaves pp out.
    let search = ["search", "tiny", "--gpus", "4", "--seq", "64", "--global-batch", "8", "--top", "400"];
    let found = json_of(&[&search[..], &["--format", "json"]].concat());
    let plans = found["plans"].as_array().expect("plans");
    let pipelined = plans.iter().find(|plan| plan["mesh"].as_str().expect("mesh").contains("pp=2")).expect("a pp plan");
    assert_eq!(pipelined["compiles_today"], true, "{pipelined}");
    let mesh = pipelined["mesh"].as_str().expect("mesh");
    let dp: u64 = mesh.split(',').find_map(|axis| axis.strip_prefix("dp=")).map_or(1, |d| d.parse().unwrap());
    let count = |key: &str| pipelined[key].as_u64().expect(key);
    let batch = (count("micro_batch") * dp * count("micro_batches")).to_string();
    let (micro_batches, zero) = (count("micro_batches").to_string(), count("zero").to_string());
    let recompute = pipelined["recompute"].as_str().expect("recompute");
    let trained = json_of(&[
        "run",
        "tiny",
        "--train",
        "--mesh",
        mesh,
        "--seq",
        "64",
        "--batch",
        &batch,
        "--micro-batches",
        &micro_batches,
        "--zero",
        &zero,
        "--recompute",
        recompute,
        "--steps",
        "1",
        "--check",
        "--format",
        "json",
    ]);
    cli::assert_matches_reference(&trained, mesh);
    let table = stdout_of(&search);
    assert!(!table.contains("model only"), "{table}");
    let inference = json_of(&[&search[..], &["--infer", "--format", "json"]].concat());
    let meshes: Vec<&str> =
        inference["plans"].as_array().expect("plans").iter().map(|plan| plan["mesh"].as_str().expect("mesh")).collect();
    assert!(!meshes.is_empty() && meshes.iter().all(|mesh| !mesh.contains("pp=")), "{meshes:?}");
}
