//! TSP's promises, measured by the executor: the forward communication a layer a rank is exactly
//! (D-1)/D·(16h² + 2BSh) elements (against Megatron TP's (D-1)/D·4BSh), and weights and layer
//! activations a rank fall by 1/D.

mod common;

use pleat_ir::model::config::ModelConfig;
use pleat_ir::model::preset::preset;
use pleat_runtime::comm::CollectiveKind;
use pleat_runtime::weights::SeededWeights;
use pleat_runtime::RankOutcome;

/// The paper's setting at a small size: multi-head attention (kv heads = heads), gated MLP with
/// ffn = 4h, f32.
fn paper_shaped(layers: u64) -> ModelConfig {
    let mut config = preset("tiny").expect("tiny");
    (config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim) = (64, 4, 4, 16);
    config.intermediate_size = 4 * 64;
    config.vocab_size = 64;
    config.num_layers = layers;
    config
}

fn run(config: &ModelConfig, batch: u64, seq: u64, mesh: &str) -> Vec<RankOutcome> {
    let (_, programs) = common::compile(config, batch, seq, mesh);
    let weights = SeededWeights::new(3);
    let tokens = common::tokens(batch, seq, config.vocab_size);
    common::run(&programs, &tokens, seq, &weights).1
}

/// Bytes sent by all ranks together, over the kinds a forward pass uses.
fn total_sent(outcomes: &[RankOutcome]) -> u64 {
    let kinds = [
        CollectiveKind::AllReduce,
        CollectiveKind::ReduceScatter,
        CollectiveKind::AllGather,
        CollectiveKind::Broadcast,
        CollectiveKind::SendRecv,
    ];
    outcomes.iter().flat_map(|outcome| kinds.map(|kind| outcome.comm.bytes(kind))).sum()
}

fn layer_sp_bytes(mesh: &str, batch: u64, seq: u64) -> u64 {
    let sent = |layers| {
        let config = paper_shaped(layers);
        let (_, programs) = common::compile_sp(&config, batch, seq, mesh);
        let tokens = common::tokens(batch, seq, config.vocab_size);
        total_sent(&common::run(&programs, &tokens, seq, &SeededWeights::new(3)).1)
    };
    sent(2) - sent(1)
}

/// One layer's bytes, all ranks together: a two-layer model's traffic minus a one-layer model's.
fn layer_bytes(mesh: &str, batch: u64, seq: u64) -> u64 {
    total_sent(&run(&paper_shaped(2), batch, seq, mesh)) - total_sent(&run(&paper_shaped(1), batch, seq, mesh))
}

#[test]
fn forward_volume_a_layer_matches_the_closed_forms() {
    let (h, batch, seq) = (64u64, 2u64, 32u64);
    for degree in [2u64, 4] {
        // Summed over the D ranks, the per-rank (D-1)/D·n becomes (D-1)·n; 4 bytes an f32.
        let tsp = layer_bytes(&format!("tsp={degree}"), batch, seq);
        assert_eq!(tsp, 4 * (degree - 1) * (16 * h * h + 2 * batch * seq * h), "tsp={degree}");
        let tp = layer_bytes(&format!("tp={degree}"), batch, seq);
        assert_eq!(tp, 4 * (degree - 1) * 4 * batch * seq * h, "tp={degree}");
        // Sequence parallelism moves the same bytes: each all-reduce becomes a reduce-scatter and an
        // all-gather of half its volume each.
        let sp = layer_sp_bytes(&format!("tp={degree}"), batch, seq);
        assert_eq!(sp, tp, "tp={degree} with sequence parallelism");
    }
}

#[test]
fn tsp_sends_less_than_tp_exactly_when_tokens_exceed_eight_h() {
    // B·S = 8h is the crossover: 16h² + 2BSh < 4BSh  <=>  BS > 8h. With h = 64 that is 512 tokens.
    for (batch, seq, tsp_wins) in [(2u64, 128u64, false), (4, 128, false), (8, 128, true)] {
        let (tsp, tp) = (layer_bytes("tsp=2", batch, seq), layer_bytes("tp=2", batch, seq));
        assert_eq!(tsp < tp, tsp_wins, "B={batch} S={seq}: tsp {tsp} bytes, tp {tp} bytes");
        assert_eq!(tsp == tp, batch * seq == 8 * 64, "B={batch} S={seq}");
    }
}

#[test]
fn weights_a_rank_are_one_dth_plus_the_replicated_norms() {
    let config = paper_shaped(2);
    let (h, ffn, vocab, layers) = (config.hidden_size, config.intermediate_size, config.vocab_size, config.num_layers);
    // Embedding, LM head, and per layer q/k/v/o and gate/up/down are split; the norms are whole.
    let matrices = 2 * vocab * h + layers * (4 * h * h + 3 * h * ffn);
    let norms = (2 * layers + 1) * h;
    for degree in [1u64, 2, 4] {
        for outcome in run(&config, 2, 32, &format!("tsp={degree}")) {
            assert_eq!(outcome.param_bytes, 4 * (matrices / degree + norms), "tsp={degree} rank {}", outcome.rank);
        }
    }
}

/// The most activation bytes a rank held during the transformer layers.
fn layer_activation_peak(config: &ModelConfig, mesh: &str) -> u64 {
    let (_, programs) = common::compile(config, 2, 64, mesh);
    let weights = SeededWeights::new(3);
    let tokens = common::tokens(2, 64, config.vocab_size);
    let (_, outcomes) = common::run(&programs, &tokens, 64, &weights);
    let program = &programs[0];
    let in_layers = |index: &usize| {
        program.instructions[*index].outs().iter().any(|&buf| program.buffer(buf).name.starts_with("layer"))
    };
    (0..program.instructions.len())
        .filter(in_layers)
        .map(|index| outcomes[0].activation_bytes[index])
        .max()
        .unwrap_or(0)
}

#[test]
fn layer_activations_a_rank_fall_by_at_least_d() {
    let config = paper_shaped(2);
    let single = layer_activation_peak(&config, "");
    for degree in [2u64, 4] {
        let sharded = layer_activation_peak(&config, &format!("tsp={degree}"));
        // Every activation in a TSP layer holds 1/D of the tokens (or, for gathered k/v, 1/D of the
        // heads); the MLP's inner activations hold 1/D of the tokens and 1/D of ffn, so the peak can
        // fall by more than D, never by less.
        assert!(sharded * degree <= single, "tsp={degree}: {sharded} bytes a rank vs {single} on one rank");
        assert!(
            sharded * degree * 4 >= single,
            "tsp={degree}: {sharded} bytes a rank is implausibly small vs {single}"
        );
    }
}
