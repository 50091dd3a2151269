//! The verifier on hand-written IR: each invariant it documents has a case whose message is checked.

use pleat_ir::text::parse_module;
use pleat_passes::verify;

/// Parses `text` (a module) and returns the verifier's first message, or "ok".
fn check(text: &str) -> String {
    let module = parse_module(text).expect("the case parses");
    match verify(&module) {
        Ok(()) => "ok".to_string(),
        Err(errors) => errors.errors[0].to_string(),
    }
}

const HEAD: &str = "; module m mesh=tp=2\n";

#[test]
fn a_row_parallel_product_is_partial_and_an_all_reduce_sums_it() {
    let text = format!(
        "{HEAD}v0: f32[batch=2, seq=4, ffn=8/tp] = param() name=\"a\"   # n0 a\n\
         v1: f32[hidden=6, ffn=8/tp] = param() name=\"w\"   # n1 w\n\
         v2: f32[batch=2, seq=4, hidden=6] partial(tp) = matmul(v0, v1) contract=1   # n2 down\n\
         v3: f32[batch=2, seq=4, hidden=6] = all_reduce(v2) axis=tp   # n3 sum\n\
         outputs(v3)\n"
    );
    assert_eq!(check(&text), "ok");
}

#[test]
fn a_spec_that_disagrees_with_its_rule_is_named() {
    let text = format!(
        "{HEAD}v0: f32[batch=2, seq=4, ffn=8/tp] = param() name=\"a\"   # n0 a\n\
         v1: f32[hidden=6, ffn=8/tp] = param() name=\"w\"   # n1 w\n\
         v2: f32[batch=2, seq=4, hidden=6] = matmul(v0, v1) contract=1   # n2 down\n\
         outputs(v2)\n"
    );
    assert_eq!(
        check(&text),
        "n2 down (matmul): its spec should be [batch, seq, hidden] partial(tp) by the matmul rule"
    );
}

#[test]
fn an_all_reduce_of_a_sharded_value_is_rejected() {
    let text = format!(
        "{HEAD}v0: f32[batch=2, seq=4, ffn=8/tp] = param() name=\"a\"   # n0 a\n\
         v1: f32[batch=2, seq=4, ffn=8/tp] = all_reduce(v0) axis=tp   # n1 bad\n\
         outputs(v1)\n"
    );
    assert_eq!(check(&text), "n1 bad (all_reduce): all_reduce over tp needs an operand that is Partial(tp)");
}

#[test]
fn shapes_that_do_not_divide_are_rejected() {
    let text = format!("{HEAD}v0: f32[ffn=7/tp, hidden=4] = param() name=\"a\"   # n0 a\noutputs()\n");
    assert_eq!(check(&text), "n0 a (param): ffn=7 does not divide by the 2 ranks splitting it");
}

#[test]
fn an_axis_the_mesh_lacks_is_rejected() {
    let text = format!("{HEAD}v0: f32[ffn=8/dp, hidden=4] = param() name=\"a\"   # n0 a\noutputs()\n");
    assert_eq!(check(&text), "n0 a (param): its spec uses axis dp, which the mesh tp=2 lacks");
}

#[test]
fn a_use_before_its_definition_is_rejected() {
    let text = format!(
        "{HEAD}v1: f32[hidden=4] = add(v0, v0)   # n1 early\n\
         v0: f32[hidden=4] = param() name=\"a\"   # n0 a\n\
         outputs(v1)\n"
    );
    assert_eq!(check(&text), "n1 early (add): operand v0 is not defined before its use");
}

#[test]
fn wrong_result_shapes_are_rejected() {
    let text = format!(
        "{HEAD}v0: f32[batch=2, hidden=4] = param() name=\"x\"   # n0 x\n\
         v1: f32[ffn=8, hidden=4] = param() name=\"w\"   # n1 w\n\
         v2: f32[batch=2, ffn=9] = matmul(v0, v1) contract=1   # n2 up\n\
         outputs(v2)\n"
    );
    assert_eq!(check(&text), "n2 up (matmul): result shape [batch=2, ffn=9] should be [batch=2, ffn=8]");
}

#[test]
fn outputs_must_not_be_pending_sums() {
    // A split output is fine (each rank returns its block); a pending sum is not.
    let split = format!("{HEAD}v0: f32[ffn=8/tp, hidden=4] = param() name=\"a\"   # n0 a\noutputs(v0)\n");
    assert_eq!(check(&split), "ok");
    let text = format!(
        "{HEAD}v0: f32[batch=2, ffn=8/tp] = param() name=\"x\"   # n0 x\n\
         v1: f32[hidden=4, ffn=8/tp] = param() name=\"w\"   # n1 w\n\
         v2: f32[batch=2, hidden=4] partial(tp) = matmul(v0, v1) contract=1   # n2 down\n\
         outputs(v2)\n"
    );
    assert_eq!(
        check(&text),
        "n2 down (matmul): is a graph output but laid out [batch, hidden] partial(tp); outputs must be summed first"
    );
}

#[test]
fn attention_needs_whole_keys() {
    let text = "; module m mesh=tsp=2\n\
         v0: f32[batch=1, seq=4/tsp, heads=2, head_dim=2] = param() name=\"q\"   # n0 q\n\
         v1: f32[batch=1, seq=4/tsp, kv_heads=2, head_dim=2] = param() name=\"k\"   # n1 k\n\
         v2: i32[seq=4/tsp] = positions()   # n2 positions\n\
         v3: f32[batch=1, seq=4/tsp, heads=2, head_dim=2] = attention(v0, v1, v1, v2, v2) causal=true   # n3 attention\n\
         outputs()\n";
    assert_eq!(
        check(text),
        "n3 attention (attention): operand 1 seq is split over tsp but every query needs all keys; all-gather keys and values on seq first"
    );
}
