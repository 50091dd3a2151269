//! Whole-graph tests of the interpreter: a tiny Llama built by `crate::model::build`, run end to end,
//! and the driver's errors.

use std::cell::RefCell;

use super::tensor::assert_close;
use super::*;
use crate::entity::EntityRef;
use crate::model::config::{Architecture, ConfigDtype, ModelConfig, RopeConfig, RopeScaling};
use crate::{AxisName, DType, DimName, NodeData, Shape, TensorType, ValueData};

/// 2 layers, hidden 32, 4 heads over 2 kv heads of 8, ffn 48, vocab 64.
fn tiny_config() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 64,
        hidden_size: 32,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 8,
        intermediate_size: 48,
        rms_norm_eps: 1e-5,
        rope: RopeConfig { theta: 10_000.0, scaling: RopeScaling::None },
        tie_word_embeddings: false,
        dtype: ConfigDtype::F32,
        attention_bias: false,
        max_position_embeddings: 128,
        sliding_window: None,
        moe: None,
        name: "tiny-test".to_string(),
    }
}

/// Seeded weights: each parameter's values come from a generator seeded by its name, uniform in
/// [-0.2, 0.2), and norm weights near 1, so every layer matters and nothing saturates.
fn seeded_param(name: &str, shape: &[u64]) -> Option<Vec<f32>> {
    let count: u64 = shape.iter().product();
    let mut state = name
        .bytes()
        .fold(0xcbf2_9ce4_8422_2325_u64, |hash, byte| (hash ^ u64::from(byte)).wrapping_mul(0x100_0000_01b3));
    let is_norm = name.ends_with("norm.weight");
    Some(
        (0..count)
            .map(|_| {
                state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
                let uniform = ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
                if is_norm {
                    1.0 + 0.1 * uniform
                } else {
                    0.2 * uniform
                }
            })
            .collect(),
    )
}

fn tiny_graph(config: &ModelConfig, batch: u64, seq: u64) -> Graph {
    crate::model::build(config, batch, seq).expect("tiny config builds").graph
}

/// Runs `graph` on `tokens` at `positions` with the seeded weights and returns its logits.
fn logits(graph: &Graph, tokens: &[u32], positions: &[u32]) -> Tensor {
    let inputs = Inputs { tokens, positions, params: &seeded_param };
    let mut outputs = run(graph, &inputs).expect("tiny model runs");
    assert_eq!(outputs.len(), 1);
    outputs.remove(0)
}

fn natural_positions(seq: u32) -> Vec<u32> {
    (0..seq).collect()
}

/// The error of running `graph` with `tokens`, natural positions and the seeded weights.
fn run_error(graph: &Graph, tokens: &[u32], seq: u32) -> String {
    let positions = natural_positions(seq);
    let inputs = Inputs { tokens, positions: &positions, params: &seeded_param };
    run(graph, &inputs).expect_err("run fails").to_string()
}

#[test]
fn tiny_model_gives_finite_distinct_logits() {
    let graph = tiny_graph(&tiny_config(), 2, 6);
    let tokens = [1, 5, 9, 63, 0, 17, 2, 2, 40, 41, 7, 30];
    let output = logits(&graph, &tokens, &natural_positions(6));
    assert_eq!(output.shape, vec![2, 6, 64]);
    assert!(output.data.iter().all(|value| value.is_finite()));
    // Rows differ: the logits depend on the tokens.
    assert_ne!(output.data[..64], output.data[64..128]);
}

#[test]
fn shifting_every_position_keeps_logits() {
    // Rotary embedding turns q and k by their absolute positions, so scores depend only on position
    // differences: positions 100..106 give the logits of 0..6, up to f32 rounding of the angles.
    let graph = tiny_graph(&tiny_config(), 1, 6);
    let tokens = [1, 5, 9, 63, 0, 17];
    let natural = logits(&graph, &tokens, &natural_positions(6));
    let shifted: Vec<u32> = (100..106).collect();
    assert_close(&logits(&graph, &tokens, &shifted), &natural, 1e-4);
    // Spreading the positions out changes the differences, and with them the logits.
    let spread: Vec<u32> = (0..6).map(|position| position * 7).collect();
    let (_, difference) = logits(&graph, &tokens, &spread).max_abs_diff(&natural).unwrap();
    assert!(difference > 1e-3, "positions must matter, largest change {difference}");
}

#[test]
fn zero_layer_model_is_embed_norm_head() {
    // With no layers the model is logits = rms_norm(embed[token]) · lm_headᵀ; compute that directly.
    let config = ModelConfig { num_layers: 0, ..tiny_config() };
    let graph = tiny_graph(&config, 1, 3);
    let tokens = [3, 60, 3];
    let actual = logits(&graph, &tokens, &natural_positions(3));
    let (hidden, vocab) = (32, 64);
    let table = seeded_param("model.embed_tokens.weight", &[64, 32]).unwrap();
    let norm = seeded_param("model.norm.weight", &[32]).unwrap();
    let head = seeded_param("lm_head.weight", &[64, 32]).unwrap();
    let mut expected = Vec::new();
    for &token in &tokens {
        let row: Vec<f64> = table[token as usize * hidden..][..hidden].iter().map(|&x| f64::from(x)).collect();
        let rms = (row.iter().map(|x| x * x).sum::<f64>() / hidden as f64 + 1e-5).sqrt();
        let normed: Vec<f64> = row.iter().zip(&norm).map(|(x, &w)| x / rms * f64::from(w)).collect();
        for word in 0..vocab {
            let weights = &head[word * hidden..][..hidden];
            expected.push(normed.iter().zip(weights).map(|(x, &w)| x * f64::from(w)).sum::<f64>() as f32);
        }
    }
    assert_close(&actual, &Tensor::new(vec![1, 3, 64], expected).unwrap(), 1e-5);
}

#[test]
fn a_later_token_does_not_change_earlier_logits() {
    let graph = tiny_graph(&tiny_config(), 2, 6);
    let positions = natural_positions(6);
    let tokens = [1, 5, 9, 63, 0, 17, 2, 2, 40, 41, 7, 30];
    let mut changed = tokens;
    changed[4] = 50; // Batch 0, position 4.
    let (before, after) = (logits(&graph, &tokens, &positions), logits(&graph, &changed, &positions));
    let row = |t: &Tensor, batch: usize, position: usize| t.data[(batch * 6 + position) * 64..][..64].to_vec();
    for position in 0..4 {
        assert_eq!(row(&before, 0, position), row(&after, 0, position), "position {position} changed");
    }
    assert_ne!(row(&before, 0, 4), row(&after, 0, 4), "the changed token must change its own logits");
    assert_ne!(row(&before, 0, 5), row(&after, 0, 5), "a later position must see the changed token");
    for position in 0..6 {
        assert_eq!(row(&before, 1, position), row(&after, 1, position), "batch 1 must not see batch 0");
    }
}

#[test]
fn permuting_tokens_and_positions_permutes_logits() {
    // Zigzag order for cp = 2 over 8 tokens: slot i holds position order[i].
    let order: [u32; 8] = [0, 1, 6, 7, 2, 3, 4, 5];
    let graph = tiny_graph(&tiny_config(), 2, 8);
    let tokens: Vec<u32> = (0..16).map(|i| (i * 37 + 11) % 64).collect();
    let natural = logits(&graph, &tokens, &natural_positions(8));
    let permuted_tokens: Vec<u32> = (0..2)
        .flat_map(|batch| order.iter().map(move |&position| (batch, position)))
        .map(|(batch, position)| tokens[batch * 8 + position as usize])
        .collect();
    let permuted = logits(&graph, &permuted_tokens, &order);
    let mut unpermuted = Tensor::zeros(natural.shape.clone());
    for batch in 0..2 {
        for (slot, &position) in order.iter().enumerate() {
            let from = (batch * 8 + slot) * 64;
            let to = (batch * 8 + position as usize) * 64;
            unpermuted.data[to..to + 64].copy_from_slice(&permuted.data[from..from + 64]);
        }
    }
    assert_close(&unpermuted, &natural, 1e-5);
}

#[test]
fn run_all_keeps_every_value() {
    let graph = tiny_graph(&tiny_config(), 1, 4);
    let (tokens, positions) = ([4, 8, 15, 16], natural_positions(4));
    let inputs = Inputs { tokens: &tokens, positions: &positions, params: &seeded_param };
    let values = run_all(&graph, &inputs).unwrap();
    assert_eq!(values.iter().count(), graph.order().len());
    assert_eq!(values.get(graph.find("layer0.q").unwrap()).unwrap().shape, vec![1, 4, 4, 8]);
    assert_eq!(values.get(graph.find("layer1.k_rope").unwrap()).unwrap().shape, vec![1, 4, 2, 8]);
    let from_all = values.get(graph.outputs()[0]).unwrap();
    assert_eq!(from_all, &logits(&graph, &tokens, &positions));
}

#[test]
fn stored_as_declared_every_bf16_value_is_rounded_and_nothing_else() {
    // The bf16 graph: every value but the token ids, positions and logits is declared bf16.
    let bf16 = ModelConfig { dtype: ConfigDtype::Bf16, ..tiny_config() };
    let graph = tiny_graph(&bf16, 1, 4);
    let (tokens, positions) = ([4, 8, 15, 16], natural_positions(4));
    let inputs = Inputs { tokens: &tokens, positions: &positions, params: &seeded_param };
    let stored = run_all_as_stored(&graph, &inputs).unwrap();
    let plain = run_all(&graph, &inputs).unwrap();
    let mut rounded = 0;
    for (value, tensor) in stored.iter() {
        let declared = graph.value(value).ty.dtype;
        // A bf16 value holds bf16 numbers only: the low 16 bits of each f32 are zero.
        let representable = tensor.data.iter().all(|x| x.to_bits() & 0xffff == 0);
        if declared == DType::Bf16 {
            assert!(representable, "{} is declared bf16", graph.def(value).name);
            rounded += 1;
        }
    }
    assert!(rounded > 10, "{rounded} bf16 values");
    // The parameters are the seeded ones rounded once, to nearest even.
    let weight = graph.find("model.layers.0.mlp.up_proj.weight").unwrap();
    let seeded = seeded_param("model.layers.0.mlp.up_proj.weight", &[48, 32]).unwrap();
    let want: Vec<f32> = seeded.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect();
    assert_eq!(stored.get(weight).unwrap().data, want);
    assert_eq!(plain.get(weight).unwrap().data, seeded);
    // The logits come out of rounded activations, a bf16 value apart from f32's.
    let (stored, plain) = (stored.get(graph.outputs()[0]).unwrap(), plain.get(graph.outputs()[0]).unwrap());
    let apart = stored.data.iter().zip(&plain.data).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
    assert!(apart > 1e-4 && apart < 0.1, "{apart}");
    // An f32 graph is unchanged.
    let graph = tiny_graph(&tiny_config(), 1, 4);
    let outputs = run_as_stored(&graph, &inputs).unwrap();
    assert_eq!(outputs[0], logits(&graph, &tokens, &positions));
}

#[test]
fn qwen2_biases_and_tied_embeddings_are_read() {
    let config = ModelConfig { architecture: Architecture::Qwen2, tie_word_embeddings: true, ..tiny_config() };
    let graph = tiny_graph(&config, 1, 3);
    let requested = RefCell::new(Vec::new());
    let params = |name: &str, shape: &[u64]| {
        requested.borrow_mut().push(name.to_string());
        seeded_param(name, shape)
    };
    let (tokens, positions) = ([1, 2, 3], natural_positions(3));
    let outputs = run(&graph, &Inputs { tokens: &tokens, positions: &positions, params: &params }).unwrap();
    assert!(outputs[0].data.iter().all(|value| value.is_finite()));
    let requested = requested.into_inner();
    assert!(requested.iter().any(|name| name == "model.layers.1.self_attn.v_proj.bias"));
    assert!(!requested.iter().any(|name| name == "lm_head.weight"));
}

#[test]
fn bad_inputs_are_named() {
    let graph = tiny_graph(&tiny_config(), 2, 6);
    assert_eq!(
        run_error(&graph, &[0; 5], 6),
        "n0 (tokens): tokens has 5 entries but the graph needs 12 (shape [2, 6]); pass one entry per element"
    );
    let mut tokens = [0; 12];
    tokens[8] = 64;
    assert_eq!(
        run_error(&graph, &tokens, 6),
        "n3 (embed): embedding: token 64 at index [1, 2] is outside the vocabulary of 64; check that the tokenizer \
         matches the model"
    );
    tokens[8] = 1 << 24;
    assert_eq!(
        run_error(&graph, &tokens, 6),
        "n0 (tokens): tokens entry 8 is 16777216, at or above 2^24 = 16777216, which f32 cannot hold exactly; use \
         smaller ids"
    );
    let positions = natural_positions(5);
    let inputs = Inputs { tokens: &[0; 12], positions: &positions, params: &seeded_param };
    assert_eq!(
        run(&graph, &inputs).unwrap_err().to_string(),
        "n1 (positions): positions has 5 entries but the graph needs 6 (shape [6]); pass one entry per element"
    );
}

#[test]
fn bad_params_are_named() {
    let graph = tiny_graph(&tiny_config(), 1, 2);
    let positions = natural_positions(2);
    let missing = |name: &str, shape: &[u64]| if name.contains("k_proj") { None } else { seeded_param(name, shape) };
    let inputs = Inputs { tokens: &[0, 1], positions: &positions, params: &missing };
    let error = run(&graph, &inputs).unwrap_err();
    assert!(matches!(error, InterpError::MissingParam { .. }));
    assert!(
        error.to_string().ends_with(
            "(model.layers.0.self_attn.k_proj.weight): parameter `model.layers.0.self_attn.k_proj.weight` with shape \
             [2, 8, 32] is missing; supply it from a checkpoint that matches the config"
        ),
        "{error}"
    );
    let short = |name: &str, shape: &[u64]| {
        let mut data = seeded_param(name, shape)?;
        if name == "model.norm.weight" {
            data.pop();
        }
        Some(data)
    };
    let inputs = Inputs { tokens: &[0, 1], positions: &positions, params: &short };
    let error = run(&graph, &inputs).unwrap_err().to_string();
    assert!(
        error.ends_with(
            "(model.norm.weight): parameter `model.norm.weight` has 31 elements but shape [32] needs 32; check that \
             the checkpoint matches the config"
        ),
        "{error}"
    );
}

#[test]
fn sharded_graphs_are_refused() {
    let mut graph = tiny_graph(&tiny_config(), 1, 2);
    let gate = graph.find("layer0.gate_proj").unwrap();
    graph.value_mut(gate).spec = ShardSpec::replicated(3).with_shard(2, AxisName::Tp);
    let node = graph.value(gate).def;
    assert_eq!(
        run_error(&graph, &[0, 1], 2),
        format!(
            "{node} (layer0.gate_proj): {gate} is split over tp on dim 2 (ffn); the reference interpreter runs \
             unsharded graphs only (every spec replicated, no communication ops), so interpret the graph before the \
             sharding passes"
        )
    );

    let mut graph = tiny_graph(&tiny_config(), 1, 2);
    let down = graph.find("layer0.down_proj").unwrap();
    let (anchor, ty) = (graph.value(down).def, graph.value(down).ty.clone());
    let spec = ShardSpec::replicated(3);
    graph.insert_after(anchor, Op::AllReduce { axis: AxisName::Tp }, &[down], ty, spec, "layer0.mlp_all_reduce");
    let error = run_error(&graph, &[0, 1], 2);
    assert!(error.contains("(layer0.mlp_all_reduce): op all_reduce moves data between ranks;"), "{error}");
}

#[test]
fn bad_graphs_are_named() {
    // A declared type that disagrees with what the op computes.
    let mut graph = tiny_graph(&tiny_config(), 1, 2);
    let gate = graph.find("layer0.gate_proj").unwrap();
    graph.value_mut(gate).ty =
        TensorType::new(DType::F32, &[(DimName::Batch, 1), (DimName::Seq, 2), (DimName::Ffn, 47)]);
    let node = graph.value(gate).def;
    assert_eq!(
        run_error(&graph, &[0, 1], 2),
        format!(
            "{node} (layer0.gate_proj): computed shape [1, 2, 48] but the graph declares [1, 2, 47]; fix the node's \
             result type"
        )
    );

    // An operand defined after its user, and an output no node computes.
    let positions_ty = TensorType { dtype: DType::I32, shape: Shape::new(&[(DimName::Seq, 2)]) };
    let value = |node: u32| ValueData {
        ty: positions_ty.clone(),
        spec: ShardSpec::replicated(1),
        def: NodeId::new(node as usize),
    };
    let nodes = vec![
        NodeData {
            op: Op::Add,
            inputs: vec![ValueId::new(1), ValueId::new(1)],
            result: ValueId::new(0),
            name: "sum".into(),
        },
        NodeData { op: Op::Positions, inputs: vec![], result: ValueId::new(1), name: "positions".into() },
    ];
    let out_of_order =
        Graph::from_parts(nodes.clone(), vec![value(0), value(1)], vec![NodeId::new(0), NodeId::new(1)], vec![]);
    assert_eq!(
        run_error(&out_of_order, &[], 2),
        "n0 (sum): operand v1 is not computed before this node; define every operand earlier in the program order"
    );
    let unordered = Graph::from_parts(nodes, vec![value(0), value(1)], vec![], vec![ValueId::new(1)]);
    assert_eq!(
        run_error(&unordered, &[], 2),
        "graph output v1 is not computed by any node in the program order; add its node to the order"
    );
}
