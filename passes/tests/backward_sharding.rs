//! The sharding rules of the loss and the backward ops, on hand-written IR: the verifier accepts
//! each case's stated layout (derived by hand from the rule's comment) and names the rule when a
//! layout is wrong.

use pleat_ir::text::parse_module;
use pleat_passes::verify;

fn check(text: &str) -> String {
    let module = parse_module(text).expect("the case parses");
    match verify(&module) {
        Ok(()) => "ok".to_string(),
        Err(errors) => errors.errors[0].to_string(),
    }
}

#[test]
fn a_data_parallel_weight_gradient_is_a_pending_sum() {
    // dW = dyᵀ·x contracts batch and seq; both are split over dp, so each rank holds a summand.
    let text = "; module m mesh=dp=2\n\
        v0: f32[batch=4/dp, seq=2, ffn=8] = param() name=\"dy\"   # n0 dy\n\
        v1: f32[batch=4/dp, seq=2, hidden=4] = param() name=\"x\"   # n1 x\n\
        v2: f32[ffn=8, hidden=4] partial(dp) = matmul_grad_weight(v0, v1) contract=1   # n2 dw\n\
        v3: f32[ffn=8, hidden=4] = all_reduce(v2) axis=dp   # n3 dw.sum\n\
        outputs(v3)\n";
    assert_eq!(check(text), "ok");
    let wrong = text
        .replace("partial(dp) = matmul_grad_weight", "= matmul_grad_weight")
        .replace("v3: f32[ffn=8, hidden=4] = all_reduce(v2) axis=dp   # n3 dw.sum\n", "");
    let wrong = wrong.replace("outputs(v3)", "outputs(v2)");
    assert_eq!(
        check(&wrong),
        "n2 dw (matmul_grad_weight): its spec should be [ffn, hidden] partial(dp) by the matmul_grad_weight rule"
    );
}

#[test]
fn a_column_parallel_input_gradient_is_a_pending_sum_over_tp() {
    // Megatron's f operator: dx = dy·W contracts the ffn dim both split over tp.
    let text = "; module m mesh=tp=2\n\
        v0: f32[batch=2, seq=2, ffn=8/tp] = param() name=\"dy\"   # n0 dy\n\
        v1: f32[ffn=8/tp, hidden=4] = param() name=\"w\"   # n1 w\n\
        v2: f32[batch=2, seq=2, hidden=4] partial(tp) = matmul_grad_input(v0, v1) contract=1   # n2 dx\n\
        v3: f32[batch=2, seq=2, hidden=4] = all_reduce(v2) axis=tp   # n3 dx.sum\n\
        outputs(v3)\n";
    assert_eq!(check(text), "ok");
}

#[test]
fn key_gradients_are_pending_over_split_queries() {
    // Queries split on seq over tsp and heads over nothing; keys whole: each rank's dk holds its
    // queries' share.
    let text = "; module m mesh=tsp=2\n\
        v0: f32[batch=1, seq=4/tsp, heads=2, head_dim=2] = param() name=\"q\"   # n0 q\n\
        v1: f32[batch=1, seq=4, kv_heads=2, head_dim=2] = param() name=\"k\"   # n1 k\n\
        v2: f32[batch=1, seq=4, kv_heads=2, head_dim=2] = param() name=\"v\"   # n2 v\n\
        v3: i32[seq=4/tsp] = positions()   # n3 q_pos\n\
        v4: i32[seq=4] = positions()   # n4 k_pos\n\
        v5: f32[batch=1, seq=4/tsp, heads=2, head_dim=2] = param() name=\"dy\"   # n5 dy\n\
        v6: f32[batch=1, seq=4, kv_heads=2, head_dim=2] partial(tsp) = attention_grad_key(v0, v1, v2, v3, v4, v5) causal=true   # n6 dk\n\
        v7: f32[batch=1, seq=4/tsp, kv_heads=2, head_dim=2] = reduce_scatter(v6) axis=tsp dim=seq   # n7 dk.mine\n\
        v8: f32[batch=1, seq=4/tsp, heads=2, head_dim=2] = attention_grad_query(v0, v1, v2, v3, v4, v5) causal=true   # n8 dq\n\
        outputs(v7, v8)\n";
    assert_eq!(check(text), "ok");
}

#[test]
fn reduce_to_root_turns_a_pending_sum_into_the_owners_block() {
    let text = "; module m mesh=tsp=2\n\
        v0: f32[heads=2, hidden=4] partial(tsp) = param() name=\"dw_owner1\"   # n0 dw\n\
        v1: f32[heads=4/tsp, hidden=4] = reduce_to_root(v0) axis=tsp dim=heads root=1   # n1 dw.home\n\
        outputs(v1)\n";
    assert_eq!(check(text), "ok");
    let replicated = text.replace(" partial(tsp) = param()", " = param()");
    assert!(check(&replicated).contains("reduce_to_root over tsp needs an operand that is Partial(tsp)"));
    let bad_root = text.replace("root=1", "root=2");
    assert!(check(&bad_root).contains("root=2 is not a coordinate of tsp=2"), "{}", check(&bad_root));
}

#[test]
fn the_loss_sums_over_the_batch_split_and_needs_whole_rows() {
    let text = "; module m mesh=dp=2\n\
        v0: f32[batch=4/dp, seq=3, vocab=8] = param() name=\"logits\"   # n0 logits\n\
        v1: i32[batch=4/dp, seq=3] = tokens()   # n1 tokens\n\
        v2: f32[] partial(dp) = cross_entropy(v0, v1)   # n2 loss\n\
        v3: f32[] = all_reduce(v2) axis=dp   # n3 loss.sum\n\
        v4: f32[batch=4/dp, seq=3, vocab=8] = cross_entropy_grad(v0, v1)   # n4 dlogits\n\
        outputs(v3, v4)\n";
    assert_eq!(check(text), "ok");
    let vocab_split = "; module m mesh=tp=2\n\
        v0: f32[batch=4, seq=3, vocab=8/tp] = param() name=\"logits\"   # n0 logits\n\
        v1: i32[batch=4, seq=3] = tokens()   # n1 tokens\n\
        v2: f32[] = cross_entropy(v0, v1)   # n2 loss\n\
        outputs(v2)\n";
    assert!(check(vocab_split).contains("the activation's vocab is split over tp"), "{}", check(vocab_split));
}

#[test]
fn ring_mlp_weight_gradients_arrive_split_like_their_weights() {
    // Each shard's gradient travels the ring over tsp and sums every rank's tokens (seq split over
    // tsp): it lands home complete, split on ffn as the weight is; the batch split over dp leaves
    // a pending sum.
    let text = "; module m mesh=dp=2,tsp=2\n\
        v0: f32[batch=2/dp, seq=4/tsp, hidden=4] = param() name=\"x\"   # n0 x\n\
        v1: f32[ffn=8/tsp, hidden=4] = param() name=\"gate\"   # n1 gate\n\
        v2: f32[ffn=8/tsp, hidden=4] = param() name=\"up\"   # n2 up\n\
        v3: f32[hidden=4, ffn=8/tsp] = param() name=\"down\"   # n3 down\n\
        v4: f32[batch=2/dp, seq=4/tsp, hidden=4] = param() name=\"dy\"   # n4 dy\n\
        v5: f32[ffn=8/tsp, hidden=4] partial(dp) = ring_gated_mlp_grad(v0, v1, v2, v3, v4) axis=tsp wrt=gate   # n5 d_gate\n\
        v6: f32[batch=2/dp, seq=4/tsp, hidden=4] = ring_gated_mlp_grad(v0, v1, v2, v3, v4) axis=tsp wrt=x   # n6 dx\n\
        v7: f32[ffn=8/tsp, hidden=4] = all_reduce(v5) axis=dp   # n7 d_gate.sum\n\
        outputs(v7, v6)\n";
    assert_eq!(check(text), "ok");
    // Tokens replicated over tsp: every rank would add the same rows to each shard's gradient.
    let replicated = text.replace("seq=4/tsp", "seq=4");
    assert_eq!(
        check(&replicated),
        "n5 d_gate (ring_gated_mlp_grad): the ring's weight gradients sum the rows of every rank on tsp, but x's \
         rows are not split over tsp"
    );
}
