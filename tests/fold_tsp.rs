//! egg's `fold-tp-sp-into-tsp` (`--strategy tp-sp-or-tsp`): where the cost model finds moving
//! weights cheaper than moving tokens, the tp axis of a tensor-and-sequence-parallel plan is folded
//! into TSP. The folded plan gives the reference's logits, sends exactly what `--mesh tsp=D`
//! sends a layer, and is chosen or not by the numbers, as the TSP paper's volume formula says.

mod common;

use pleat_ir::model::config::ModelConfig;
use pleat_ir::model::preset::preset;
use pleat_ir::{Mesh, Module};
use pleat_passes::cost::hw::HardwareSpec;
use pleat_passes::rewrite::{rewrite_collectives, RewriteOptions};
use pleat_passes::{cp, propagate, run_pipeline, tsp, verify, PassCtx};
use pleat_runtime::comm::CollectiveKind;
use pleat_runtime::weights::SeededWeights;

/// tiny with `kv_heads` kv heads: grouped-query attention, whose gathered keys and values are
/// smaller than the hidden states, so the folded attention can move fewer bytes than the gathered.
fn gqa_tiny(layers: u64, kv_heads: u64) -> ModelConfig {
    let mut config = preset("tiny").expect("tiny preset");
    config.num_kv_heads = kv_heads;
    config.num_layers = layers;
    config
}

/// H100 links with no latency: the choice is made by bytes alone, so that it flips at the sizes
/// a CPU test can run.
fn bytes_only() -> RewriteOptions {
    let mut hardware = HardwareSpec::builtin("h100-sxm").expect("built-in");
    hardware.intra_node.latency_s = 0.0;
    hardware.inter_node.latency_s = 0.0;
    RewriteOptions { hardware, ..RewriteOptions::default() }
}

fn fold_ctx() -> PassCtx {
    PassCtx { sequence_parallel: true, fold_into_tsp: true, ..PassCtx::default() }
}

/// `config` on `mesh`, propagated with sequence parallelism, then rewritten by egg with `options`.
fn folded(config: &ModelConfig, batch: u64, seq: u64, mesh: &str, options: &RewriteOptions) -> Module {
    let mut module = pleat_ir::model::build(config, batch, seq).expect("build");
    module.mesh = Mesh::parse(mesh).expect("mesh");
    let ctx = fold_ctx();
    run_pipeline(&[tsp::FOLD_TSP, cp::FOLD_CP, propagate::PROPAGATE_SPECS], &mut module, &ctx).expect("propagate");
    let report = rewrite_collectives(&mut module, &ctx, options).expect("rewrite");
    assert!(report.tables.contains(&"fold-tp-sp-into-tsp"), "{report:?}");
    verify(&module).expect("the folded module verifies");
    module
}

fn count(module: &Module, mnemonic: &str) -> usize {
    let graph = &module.graph;
    graph.order().iter().filter(|&&node| graph.node(node).op.mnemonic() == mnemonic).count()
}

fn lower(module: &Module) -> Vec<pleat_backend::Program> {
    let programs = pleat_backend::lower(module).expect("lower");
    pleat_backend::verify_collectives(&programs).expect("collectives match");
    programs
}

/// A sequence long enough for the folded forms to move fewer bytes on tiny.
const SEQ: u64 = 512;

#[test]
fn long_sequences_fold_into_tsp_and_match_the_reference() {
    for degree in [2, 4] {
        let config = gqa_tiny(2, degree);
        let module = folded(&config, 2, SEQ, &format!("tp={degree}"), &bytes_only());
        // Every layer: D owners' q, k, v and o blocks broadcast, the ring MLP, and no reduce-scatter
        // left but the embedding's.
        assert_eq!(count(&module, "broadcast_shard"), 2 * degree as usize * 4, "tp={degree}");
        assert_eq!(count(&module, "ring_gated_mlp"), 2, "tp={degree}");
        assert_eq!(count(&module, "reduce_scatter"), 1, "tp={degree}");
        common::check_programs(&config, 2, SEQ, &format!("tp={degree} folded"), lower(&module));
    }
}

#[test]
fn short_sequences_keep_the_gathered_attention() {
    // 2·16 tokens: the weights outweigh the tokens (the ring MLP's hop moves 3·h·ffn/D elements
    // against B·S·h for its all-gather and reduce-scatter), so every block keeps its all-gather and
    // reduce-scatter, and the plan is plain sequence parallelism.
    let config = gqa_tiny(2, 2);
    let module = folded(&config, 2, 16, "tp=2", &bytes_only());
    assert_eq!(count(&module, "broadcast_shard") + count(&module, "ring_gated_mlp"), 0);
    assert_eq!(count(&module, "reduce_scatter"), 1 + 2 * 2, "the embedding's and two a layer");
    common::check_programs(&config, 2, 16, "tp=2 short", lower(&module));
}

/// Bytes a rank sent by kind, one layer's: the two-layer plan minus the one-layer plan (rank 0).
fn layer_bytes(programs_of: impl Fn(u64) -> Vec<pleat_backend::Program>, seq: u64) -> Vec<(CollectiveKind, u64)> {
    let sent = |layers: u64| {
        let config = gqa_tiny(layers, 2);
        let ids = common::tokens(2, seq, config.vocab_size);
        let (_, outcomes) = common::run(&programs_of(layers), &ids, seq, &SeededWeights::new(5));
        let kinds = [CollectiveKind::Broadcast, CollectiveKind::AllGather, CollectiveKind::SendRecv];
        kinds.map(|kind| (kind, outcomes[0].comm.bytes(kind)))
    };
    let (two, one) = (sent(2), sent(1));
    two.iter().zip(one).map(|(&(kind, two), (_, one))| (kind, two - one)).collect()
}

#[test]
fn a_folded_layer_sends_what_a_tsp_layer_sends() {
    let seq = SEQ;
    let folded_bytes = layer_bytes(|layers| lower(&folded(&gqa_tiny(layers, 2), 2, seq, "tp=2", &bytes_only())), seq);
    let tsp_bytes = layer_bytes(|layers| common::compile(&gqa_tiny(layers, 2), 2, seq, "tsp=2").1, seq);
    assert_eq!(folded_bytes, tsp_bytes);
    // And that is the volume of docs/tsp: (D-1)/D of the attention and MLP weights, plus (D-1)/D
    // of the keys and values, 4 bytes an element (tiny: h=128, ffn=256, head_dim=16).
    let (h, ffn, kv, tokens) = (128u64, 256u64, 2 * 16u64, 2 * seq);
    let weights = 2 * h * h + 2 * h * kv + 3 * h * ffn;
    let total: u64 = folded_bytes.iter().map(|(_, bytes)| bytes).sum();
    assert_eq!(total, 4 * (weights + 2 * tokens * kv) / 2);
}

#[test]
fn snapshot_of_one_folded_layer() {
    let mut module = pleat_ir::model::build(&gqa_tiny(1, 2), 2, SEQ).expect("build");
    module.mesh = Mesh::parse("tp=2").expect("mesh");
    let ctx = fold_ctx();
    run_pipeline(&[tsp::FOLD_TSP, cp::FOLD_CP, propagate::PROPAGATE_SPECS], &mut module, &ctx).expect("propagate");
    let propagated = pleat_ir::text::print_module(&module);
    rewrite_collectives(&mut module, &ctx, &bytes_only()).expect("rewrite");
    let rewritten = pleat_ir::text::print_module(&module);
    insta::with_settings!({ snapshot_suffix => "tp2-sp-fold-one-layer", prepend_module_to_snapshot => false }, {
        insta::assert_snapshot!("after_propagate-specs", propagated);
        insta::assert_snapshot!("after_rewrite-collectives", rewritten);
    });
}

#[path = "support/cli.rs"]
mod cli;

#[test]
fn the_cli_runs_checks_and_explains_the_folded_plan() {
    // On the default hardware (H100 links) the ring MLP is already cheaper on tiny; the attention
    // keeps its gathers at this length. The run is checked against the reference.
    let report =
        cli::json_of(&["run", "tiny", "--mesh", "tp=2", "--strategy", "tp-sp-or-tsp", "--check", "--format", "json"]);
    assert!(report["max_abs_err"].as_f64().expect("checked") < 1e-4, "{report}");
    let explained =
        cli::json_of(&["explain", "tiny", "--mesh", "tp=2", "--strategy", "tp-sp-or-tsp", "--format", "json"]);
    let rewrite = &explained["rewrite"];
    assert!(rewrite["tables"].as_array().expect("tables").iter().any(|table| table == "fold-tp-sp-into-tsp"));
    assert_eq!(rewrite["rules_fired"]["ring-weights-instead-of-gather-activations"], 1, "{rewrite}");
    assert!(rewrite["layer_seconds_after"].as_f64() < rewrite["layer_seconds_before"].as_f64(), "{rewrite}");
    let ops: Vec<&str> =
        explained["collectives"].as_array().expect("list").iter().filter_map(|c| c["op"].as_str()).collect();
    assert!(ops.contains(&"ring_gated_mlp"), "{ops:?}");
    let error = cli::error_of(&["run", "tiny", "--mesh", "tp=2", "--strategy", "tp-sp-or-tsp", "--train"]);
    assert!(error.contains("folds inference graphs only"), "{error}");
}

/// The collectives `pleat explain` lists for layer 0 of `model` on tp=8 at `seq` tokens.
fn folded_ops(model: &str, seq: u64) -> (bool, usize) {
    let seq = seq.to_string();
    let explained = cli::json_of(&[
        "explain",
        model,
        "--mesh",
        "tp=8",
        "--strategy",
        "tp-sp-or-tsp",
        "--batch",
        "1",
        "--seq",
        &seq,
        "--format",
        "json",
    ]);
    let ops: Vec<String> = explained["collectives"]
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|collective| collective["op"].as_str().map(str::to_string))
        .collect();
    (ops.iter().any(|op| op == "ring_gated_mlp"), ops.iter().filter(|op| *op == "broadcast_shard").count())
}

#[test]
fn the_fold_follows_the_volumes_on_real_models() {
    // llama3-8b (h=4096, ffn=14336, 8 kv heads of 32) on 8 ranks, H100 links: the MLP moves
    // 3·h·ffn/8 elements a hop against B·S·h for its gather and scatter, so it folds once the
    // tokens outweigh its weights; the attention's k/v are a quarter of the hidden states, so it
    // folds later, once the saved gathers outweigh its weights and the extra collectives' latency.
    assert_eq!(folded_ops("llama3-8b", 8192), (false, 0));
    assert_eq!(folded_ops("llama3-8b", 16384), (true, 0));
    assert_eq!(folded_ops("llama3-8b", 65536), (true, 8 * 4));
    // tsp-7b is MHA: the gathered k/v move as much as the hidden states they replace, plus the
    // weights, so its attention never folds by communication time.
    assert_eq!(folded_ops("tsp-7b", 131072), (true, 0));
}
