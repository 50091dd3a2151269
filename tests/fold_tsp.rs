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
    let folded_bytes =
        layer_bytes(|layers| lower(&folded(&gqa_tiny(layers, 2), 2, seq, "tp=2", &bytes_only())), seq);
    let tsp_bytes = layer_bytes(|layers| common::compile(&gqa_tiny(layers, 2), 2, seq, "tsp=2").1, seq);
    assert_eq!(folded_bytes, tsp_bytes);
    // And that is the volume of docs/tsp: (D-1)/D of the attention and MLP weights, plus (D-1)/D
    // of the keys and values, 4 bytes an element (tiny: h=128, ffn=256, head_dim=16).
    let (h, ffn, kv, tokens) = (128u64, 256u64, 2 * 16u64, 2 * seq);
    let weights = 2 * h * h + 2 * h * kv + 3 * h * ffn;
    let total: u64 = folded_bytes.iter().map(|(_, bytes)| bytes).sum();
    assert_eq!(total, 4 * (weights + 2 * tokens * kv) / 2);
}
