//! Tests of the loss and the backward ops: hand-computed values, and every backward op against
//! central finite differences of its forward op in isolation.
//!
//! The finite-difference check differentiates the scalar `sum(forward(inputs) * r)` for a random
//! cotangent `r`, whose gradient with respect to an input is exactly what the backward op computes
//! from `dy = r`. Forward results are f32, so the step is 1e-2 (rounding noise divided by the step
//! stays near 1e-5, the truncation error `h^2 f''' / 6` below that) and the tolerance is 1e-3
//! relative to the largest gradient entry.

use super::ops::eval;
use super::tensor::{assert_close, Tensor};
use crate::model::config::{RopeConfig, RopeScaling};
use crate::Op;

fn tensor(shape: &[usize], data: &[f32]) -> Tensor {
    Tensor::new(shape.to_vec(), data.to_vec()).expect("test tensor is consistent")
}

/// Deterministic values in [-1, 1) (a 64-bit LCG, top bits).
fn random(shape: &[usize], seed: u64) -> Tensor {
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
    let count = shape.iter().product();
    let data = (0..count)
        .map(|_| {
            state = state.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1_442_695_040_888_963_407);
            ((state >> 40) as f64 / (1u64 << 24) as f64 * 2.0 - 1.0) as f32
        })
        .collect();
    Tensor { shape: shape.to_vec(), data }
}

fn indices(values: &[usize]) -> Tensor {
    tensor(&[values.len()], &values.iter().map(|&value| value as f32).collect::<Vec<_>>())
}

fn run(op: &Op, operands: &[&Tensor]) -> Tensor {
    eval(op, operands).unwrap_or_else(|error| panic!("{}: {error}", op.mnemonic()))
}

/// Checks `gradient` (the backward op's result) against central differences of
/// `sum(forward(inputs) * cotangent)` with respect to `inputs[wrt]`, at every entry; returns the
/// largest error relative to the largest gradient entry.
#[track_caller]
fn check_finite_differences(forward: &Op, inputs: &[Tensor], wrt: usize, cotangent: &Tensor, gradient: &Tensor) -> f64 {
    const STEP: f32 = 1e-2;
    const TOLERANCE: f64 = 1e-3;
    assert_eq!(gradient.shape, inputs[wrt].shape, "{}: gradient shape", forward.mnemonic());
    let objective = |inputs: &[Tensor]| -> f64 {
        let operands: Vec<&Tensor> = inputs.iter().collect();
        let output = run(forward, &operands);
        output.data.iter().zip(&cotangent.data).map(|(&y, &r)| f64::from(y) * f64::from(r)).sum()
    };
    let scale = gradient.data.iter().fold(0.0_f64, |max, &g| max.max(f64::from(g).abs())).max(1e-3);
    let mut worst = 0.0_f64;
    for entry in 0..inputs[wrt].data.len() {
        let mut plus = inputs.to_vec();
        plus[wrt].data[entry] += STEP;
        let mut minus = inputs.to_vec();
        minus[wrt].data[entry] -= STEP;
        let numeric = (objective(&plus) - objective(&minus)) / (2.0 * f64::from(STEP));
        let error = (numeric - f64::from(gradient.data[entry])).abs() / scale;
        assert!(
            error <= TOLERANCE,
            "{} operand {wrt} entry {entry}: backward {} vs finite difference {numeric} (max |grad| {scale})",
            forward.mnemonic(),
            gradient.data[entry]
        );
        worst = worst.max(error);
    }
    worst
}

#[test]
fn cross_entropy_of_uniform_logits_is_log_vocab() {
    // Zero logits over 4 classes: every term is ln 4 = 1.3862944; softmax 0.25 everywhere.
    let logits = Tensor::zeros(vec![1, 3, 4]);
    let tokens = tensor(&[1, 3], &[0.0, 2.0, 1.0]);
    assert_close(&run(&Op::CrossEntropy, &[&logits, &tokens]), &tensor(&[], &[1.386_294_4]), 1e-6);
    // Two terms: position 0 predicts 2, position 1 predicts 1; (0.25 - onehot) / 2; last row zero.
    let expected = tensor(&[1, 3, 4], &[0.125, 0.125, -0.375, 0.125, 0.125, -0.375, 0.125, 0.125, 0.0, 0.0, 0.0, 0.0]);
    assert_close(&run(&Op::CrossEntropyGrad, &[&logits, &tokens]), &expected, 1e-6);
}

#[test]
fn cross_entropy_by_hand() {
    // One term: logits [0, ln 3] (probabilities 1/4, 3/4), target 0: -ln(1/4) = 1.3862944.
    let logits = tensor(&[1, 2, 2], &[0.0, 3.0_f32.ln(), 5.0, 5.0]);
    let tokens = tensor(&[1, 2], &[1.0, 0.0]);
    assert_close(&run(&Op::CrossEntropy, &[&logits, &tokens]), &tensor(&[], &[1.386_294_4]), 1e-6);
    let error = eval(&Op::CrossEntropy, &[&Tensor::zeros(vec![1, 1, 4]), &tensor(&[1, 1], &[0.0])]).unwrap_err();
    assert!(error.to_string().contains("seq >= 2"), "{error}");
    let error = eval(&Op::CrossEntropy, &[&logits, &tensor(&[1, 2], &[0.0, 2.0])]).unwrap_err();
    assert!(error.to_string().contains("token 2 at index [0, 1]"), "{error}");
}

#[test]
fn matmul_gradients_by_hand() {
    // x [1, 2] = [1, 2], w [3, 2] rows [1, 0], [0, 1], [1, 1]; dy [1, 3] = [1, 10, 100].
    // dx = dy · w = [1 + 100, 10 + 100] = [101, 110]; dw = dyᵀ · x = [[1, 2], [10, 20], [100, 200]].
    let x = tensor(&[1, 2], &[1.0, 2.0]);
    let w = tensor(&[3, 2], &[1.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
    let dy = tensor(&[1, 3], &[1.0, 10.0, 100.0]);
    assert_close(&run(&Op::MatMulGradInput { contract: 1 }, &[&dy, &w]), &tensor(&[1, 2], &[101.0, 110.0]), 1e-6);
    let expected = tensor(&[3, 2], &[1.0, 2.0, 10.0, 20.0, 100.0, 200.0]);
    assert_close(&run(&Op::MatMulGradWeight { contract: 1 }, &[&dy, &x]), &expected, 1e-6);
}

#[test]
fn rms_norm_weight_gradient_by_hand() {
    // x = [3, 4], eps 0: 1 / rms = 1 / 3.5355339; x / rms = [0.8485281, 1.1313708]; dy = [1, 2]
    // gives dweight = [0.8485281, 2.2627417]. Two equal rows double it.
    let x = tensor(&[2, 2], &[3.0, 4.0, 3.0, 4.0]);
    let dy = tensor(&[2, 2], &[1.0, 2.0, 1.0, 2.0]);
    let expected = tensor(&[2], &[1.697_056_2, 4.525_483_4]);
    assert_close(&run(&Op::RmsNormGradWeight { eps: 0.0 }, &[&x, &dy]), &expected, 1e-6);
}

#[test]
fn rope_gradient_undoes_rope() {
    let rope = RopeConfig { theta: 10_000.0, scaling: RopeScaling::None };
    let x = random(&[2, 3, 2, 8], 1);
    let positions = indices(&[0, 5, 17]);
    let rotated = run(&Op::Rope { rope: rope.clone() }, &[&x, &positions]);
    assert_close(&run(&Op::RopeGrad { rope }, &[&rotated, &positions]), &x, 1e-6);
}

#[test]
fn embedding_gradient_sums_rows_of_repeated_tokens() {
    // Tokens [2, 0, 2]: row 2 gets dy0 + dy2, row 0 gets dy1, row 1 stays zero.
    let dy = tensor(&[1, 3, 2], &[1.0, 2.0, 10.0, 20.0, 100.0, 200.0]);
    let tokens = tensor(&[1, 3], &[2.0, 0.0, 2.0]);
    let expected = tensor(&[3, 2], &[10.0, 20.0, 0.0, 0.0, 101.0, 202.0]);
    assert_close(&run(&Op::EmbeddingGrad { vocab: 3 }, &[&dy, &tokens]), &expected, 1e-6);
}

#[test]
fn sum_leading_keeps_trailing_dims() {
    let x = tensor(&[2, 2, 2], &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0]);
    assert_close(&run(&Op::SumLeading { keep: 2 }, &[&x]), &tensor(&[2, 2], &[6.0, 8.0, 10.0, 12.0]), 1e-6);
    assert_close(&run(&Op::SumLeading { keep: 1 }, &[&x]), &tensor(&[2], &[16.0, 20.0]), 1e-6);
    assert_close(&run(&Op::SumLeading { keep: 3 }, &[&x]), &x, 1e-6);
    assert!(eval(&Op::SumLeading { keep: 4 }, &[&x]).is_err());
}

#[test]
fn cross_entropy_gradient_matches_finite_differences() {
    let logits = random(&[2, 4, 6], 2);
    let tokens = tensor(&[2, 4], &[1.0, 5.0, 0.0, 3.0, 2.0, 2.0, 4.0, 1.0]);
    let gradient = run(&Op::CrossEntropyGrad, &[&logits, &tokens]);
    check_finite_differences(&Op::CrossEntropy, &[logits, tokens], 0, &tensor(&[], &[1.0]), &gradient);
}

#[test]
fn matmul_gradients_match_finite_differences() {
    for (contract, x_shape, w_shape, y_shape) in [
        (1_u8, vec![2, 3, 4], vec![5, 4], vec![2, 3, 5]),
        (1, vec![2, 3, 4], vec![2, 3, 4], vec![2, 3, 2, 3]),
        (2, vec![2, 3, 2, 3], vec![4, 2, 3], vec![2, 3, 4]),
    ] {
        let (x, w, dy) = (random(&x_shape, 3), random(&w_shape, 4), random(&y_shape, 5));
        let forward = Op::MatMul { contract };
        let dx = run(&Op::MatMulGradInput { contract }, &[&dy, &w]);
        let dw = run(&Op::MatMulGradWeight { contract }, &[&dy, &x]);
        check_finite_differences(&forward, &[x.clone(), w.clone()], 0, &dy, &dx);
        check_finite_differences(&forward, &[x, w], 1, &dy, &dw);
    }
}

#[test]
fn rms_norm_gradients_match_finite_differences() {
    let (x, weight, dy) = (random(&[2, 3, 6], 6), random(&[6], 7), random(&[2, 3, 6], 8));
    let eps = 1e-5;
    let dx = run(&Op::RmsNormGradInput { eps }, &[&x, &weight, &dy]);
    let dw = run(&Op::RmsNormGradWeight { eps }, &[&x, &dy]);
    check_finite_differences(&Op::RmsNorm { eps }, &[x.clone(), weight.clone()], 0, &dy, &dx);
    check_finite_differences(&Op::RmsNorm { eps }, &[x, weight], 1, &dy, &dw);
}

#[test]
fn rope_gradient_matches_finite_differences() {
    let scaling = RopeScaling::Llama3 {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 16,
    };
    for rope in [RopeConfig { theta: 10_000.0, scaling: RopeScaling::None }, RopeConfig { theta: 500_000.0, scaling }] {
        let (x, dy) = (random(&[1, 3, 2, 8], 9), random(&[1, 3, 2, 8], 10));
        let positions = indices(&[3, 0, 40]);
        let dx = run(&Op::RopeGrad { rope: rope.clone() }, &[&dy, &positions]);
        check_finite_differences(&Op::Rope { rope }, &[x, positions], 0, &dy, &dx);
    }
}

#[test]
fn attention_gradients_match_finite_differences() {
    // Four query heads over two key/value heads (groups of two), a permuted sequence, both masks.
    let (q, k, v) = (random(&[2, 4, 4, 4], 11), random(&[2, 4, 2, 4], 12), random(&[2, 4, 2, 4], 13));
    let positions = indices(&[0, 3, 1, 2]);
    let dy = random(&[2, 4, 4, 4], 14);
    for causal in [true, false] {
        let inputs = [q.clone(), k.clone(), v.clone(), positions.clone(), positions.clone()];
        let operands: Vec<&Tensor> = inputs.iter().chain([&dy]).collect();
        let gradients = [
            run(&Op::AttentionGradQuery { causal }, &operands),
            run(&Op::AttentionGradKey { causal }, &operands),
            run(&Op::AttentionGradValue { causal }, &operands),
        ];
        for (wrt, gradient) in gradients.iter().enumerate() {
            check_finite_differences(&Op::Attention { causal }, &inputs, wrt, &dy, gradient);
        }
    }
}

#[test]
fn silu_mul_gradients_match_finite_differences() {
    let (gate, up, dy) = (random(&[3, 5], 15), random(&[3, 5], 16), random(&[3, 5], 17));
    let d_gate = run(&Op::SiluMulGradGate, &[&gate, &up, &dy]);
    let d_up = run(&Op::SiluMul, &[&gate, &dy]);
    check_finite_differences(&Op::SiluMul, &[gate.clone(), up.clone()], 0, &dy, &d_gate);
    check_finite_differences(&Op::SiluMul, &[gate, up], 1, &dy, &d_up);
}

#[test]
fn gated_mlp_gradients_match_finite_differences() {
    let axis = crate::AxisName::Tsp;
    let inputs = [random(&[2, 3, 4], 30), random(&[5, 4], 31), random(&[5, 4], 32), random(&[4, 5], 33)];
    let dy = random(&[2, 3, 4], 34);
    let operands: Vec<&Tensor> = inputs.iter().chain([&dy]).collect();
    for wrt in crate::MlpOperand::ALL {
        let gradient = run(&Op::RingGatedMlpGrad { axis, wrt }, &operands);
        check_finite_differences(&Op::RingGatedMlp { axis }, &inputs, wrt.index(), &dy, &gradient);
    }
}

#[test]
fn embedding_and_bias_gradients_match_finite_differences() {
    let table = random(&[5, 3], 18);
    let tokens = tensor(&[2, 3], &[4.0, 0.0, 4.0, 1.0, 1.0, 4.0]);
    let dy = random(&[2, 3, 3], 19);
    let d_table = run(&Op::EmbeddingGrad { vocab: 5 }, &[&dy, &tokens]);
    check_finite_differences(&Op::Embedding, &[table, tokens], 0, &dy, &d_table);
    let (x, bias) = (random(&[2, 3, 4], 20), random(&[4], 21));
    let dy = random(&[2, 3, 4], 22);
    let d_bias = run(&Op::SumLeading { keep: 1 }, &[&dy]);
    check_finite_differences(&Op::Add, &[x, bias], 1, &dy, &d_bias);
}

#[test]
fn sigmoid_scale_gradients_match_finite_differences() {
    let (gate, y, dy) = (random(&[2, 3], 50), random(&[2, 3, 4], 51), random(&[2, 3, 4], 52));
    let d_gate = run(&Op::SigmoidScaleGradGate, &[&gate, &y, &dy]);
    let d_y = run(&Op::SigmoidScale, &[&gate, &dy]);
    check_finite_differences(&Op::SigmoidScale, &[gate.clone(), y.clone()], 0, &dy, &d_gate);
    check_finite_differences(&Op::SigmoidScale, &[gate, y], 1, &dy, &d_y);
    // sigmoid(0) = 1/2 halves the row; a large gate passes it whole.
    let halved = run(&Op::SigmoidScale, &[&tensor(&[2], &[0.0, 40.0]), &tensor(&[2, 2], &[2.0, 4.0, 6.0, 8.0])]);
    assert_eq!(halved.data, vec![1.0, 2.0, 6.0, 8.0]);
}

#[test]
fn moe_gradients_match_finite_differences() {
    // 6 rows, hidden 4, 4 experts of width 3; the router is scaled so that the top-2 choice of every
    // row has a probability gap far wider than the finite-difference step can close.
    let mut router = random(&[4, 4], 41);
    router.data.iter_mut().for_each(|value| *value *= 3.0);
    let inputs =
        [random(&[2, 3, 4], 40), router, random(&[4, 3, 4], 42), random(&[4, 3, 4], 43), random(&[4, 4, 3], 44)];
    let dy = random(&[2, 3, 4], 45);
    let operands: Vec<&Tensor> = inputs.iter().chain([&dy]).collect();
    for normalize in [true, false] {
        for wrt in crate::MoeOperand::ALL {
            let gradient = run(&Op::MoeMlpGrad { top_k: 2, normalize, dispatch: None, wrt }, &operands);
            check_finite_differences(
                &Op::MoeMlp { top_k: 2, normalize, dispatch: None },
                &inputs,
                wrt.index(),
                &dy,
                &gradient,
            );
        }
    }
}

#[test]
fn moe_routes_each_row_to_its_top_experts() {
    // One hidden channel, experts of width 1 whose output is exactly silu(x·g)·(x·u)·d. With x = 1 the
    // logits are the router's entries [0, ln 3, ln 2]: probabilities 1/6, 1/2, 1/3; top-2 picks
    // experts 1 and 2, renormalized to 3/5 and 2/5.
    let x = tensor(&[1, 1], &[1.0]);
    let router = tensor(&[3, 1], &[0.0, 3f32.ln(), 2f32.ln()]);
    let gate = tensor(&[3, 1, 1], &[1.0, 2.0, 3.0]);
    let up = tensor(&[3, 1, 1], &[1.0, 1.0, 1.0]);
    let down = tensor(&[3, 1, 1], &[100.0, 10.0, 1.0]);
    let silu = |value: f64| value / (1.0 + (-value).exp());
    let operands = [&x, &router, &gate, &up, &down];
    let normalized = run(&Op::MoeMlp { top_k: 2, normalize: true, dispatch: None }, &operands);
    let expected = 0.6 * silu(2.0) * 10.0 + 0.4 * silu(3.0);
    assert!((f64::from(normalized.data[0]) - expected).abs() < 1e-5, "{normalized:?} vs {expected}");
    let raw = run(&Op::MoeMlp { top_k: 2, normalize: false, dispatch: None }, &operands);
    let expected = 0.5 * silu(2.0) * 10.0 + silu(3.0) / 3.0;
    assert!((f64::from(raw.data[0]) - expected).abs() < 1e-5, "{raw:?} vs {expected}");
    // Top-1 of three equal logits takes the lowest index.
    let even = tensor(&[3, 1], &[0.5, 0.5, 0.5]);
    let first = run(&Op::MoeMlp { top_k: 1, normalize: true, dispatch: None }, &[&x, &even, &gate, &up, &down]);
    assert!((f64::from(first.data[0]) - silu(1.0) * 100.0).abs() < 1e-4, "{first:?}");
}

#[test]
fn router_statistics_by_hand_and_their_gradients() {
    // Two rows of one channel, x = 1 and x = -1, against a router of [0, ln 3, -ln 2]. Row 0's logits
    // [0, ln 3, -ln 2] give probabilities 2/9, 6/9, 1/9; row 1's [0, -ln 3, ln 2] give 3/10, 1/10,
    // 6/10. Top-1 picks expert 1 for row 0 and expert 2 for row 1.
    let x = tensor(&[2, 1], &[1.0, -1.0]);
    let router = tensor(&[3, 1], &[0.0, 3f32.ln(), -(2f32.ln())]);
    let counts = run(&Op::ExpertCounts { top_k: 1, scale: 0.5 }, &[&x, &router]);
    assert_eq!(counts.data, vec![0.0, 0.5, 0.5]);
    let sums = run(&Op::RouterProbSum, &[&x, &router]);
    let expected = [2.0 / 9.0 + 0.3, 6.0 / 9.0 + 0.1, 1.0 / 9.0 + 0.6];
    for (got, want) in sums.data.iter().zip(expected) {
        assert!((f64::from(*got) - want).abs() < 1e-6, "{got} vs {want}");
    }
    let loss = run(&Op::LoadBalancingLoss, &[&counts, &sums]);
    assert!((f64::from(loss.data[0]) - 0.5 * (expected[1] + expected[2])).abs() < 1e-6);
    // The sums' gradients against finite differences.
    let (x, router, dy) = (random(&[2, 3, 4], 60), random(&[5, 4], 61), random(&[5], 62));
    for wrt in [crate::MoeOperand::Input, crate::MoeOperand::Router] {
        let gradient = run(&Op::RouterProbSumGrad { wrt }, &[&x, &router, &dy]);
        check_finite_differences(&Op::RouterProbSum, &[x.clone(), router.clone()], wrt.index(), &dy, &gradient);
    }
}

#[test]
fn the_routing_margin_is_the_gap_at_the_top_k_cut_relative_to_the_logits_magnitudes() {
    // Two channels. Row 0, x = [1, 2], against router rows [1, 1], [2, 0], [0, 1]: logits 3, 2, 2,
    // each product sum of magnitudes 3, 2, 2; top-1 keeps 3, leaves 2: (3 - 2) / max(3, 2) = 1/3.
    // Row 1, x = [1, -1]: logits 0, 2, -1 with magnitudes 2, 2, 1; top-1 keeps 2, leaves 0:
    // (2 - 0) / 2 = 1. The margin is the smaller, 1/3; top-2 cuts row 0 between 2 and 2: a tie, 0.
    let x = tensor(&[2, 2], &[1.0, 2.0, 1.0, -1.0]);
    let router = tensor(&[3, 2], &[1.0, 1.0, 2.0, 0.0, 0.0, 1.0]);
    let top1 = super::routing_margin(&x, &router, 1).expect("a margin");
    assert!((top1 - 1.0 / 3.0).abs() < 1e-12, "{top1}");
    assert_eq!(super::routing_margin(&x, &router, 2).expect("a margin"), 0.0);
    // Row by row: top-2 keeps row 1's 2 and 0 and leaves -1 (magnitude 1): (0 + 1) / max(2, 1).
    let rows = super::routing_margins(&x, &router, 1).expect("margins");
    assert!((rows[0] - 1.0 / 3.0).abs() < 1e-12 && rows[1] == 1.0, "{rows:?}");
    assert_eq!(super::routing_margins(&x, &router, 2).expect("margins"), [0.0, 0.5]);
    // Every expert (or none) chosen: no choice to flip.
    assert_eq!(super::routing_margin(&x, &router, 3).expect("a margin"), f64::INFINITY);
    assert_eq!(super::routing_margin(&x, &router, 0).expect("a margin"), f64::INFINITY);
}
