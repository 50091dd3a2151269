//! Lowering of the loss and backward ops: each kernel gets the rank's local sizes and offsets.

use pleat_ir::text::parse_module;

use super::lower_rank;
use crate::error::Error;
use crate::program::{AttentionDims, AttentionOperand, Instr, Kernel};
use crate::validate::validate;

/// The kernels of `text`'s module lowered for `rank`, after checking the program is consistent.
fn kernels(text: &str, rank: u32) -> Vec<Kernel> {
    let module = parse_module(text).expect("parses");
    let program = lower_rank(&module, rank).expect("lowers");
    validate(&program).expect("a consistent program");
    program
        .instructions
        .into_iter()
        .filter_map(|instr| match instr {
            Instr::Kernel { kernel, .. } => Some(kernel),
            _ => None,
        })
        .collect()
}

#[test]
fn loss_on_a_batch_block_divides_by_the_global_target_count() {
    let text = "; module m mesh=dp=2\n\
        v0: i32[batch=4/dp, seq=8] = tokens()   # n0 tokens\n\
        v1: f32[batch=4/dp, seq=8, vocab=16] = param() name=\"logits\"   # n1 logits\n\
        v2: f32[] partial(dp) = cross_entropy(v1, v0)   # n2 loss\n\
        v3: f32[batch=4/dp, seq=8, vocab=16] = cross_entropy_grad(v1, v0)   # n3 loss.d0\n\
        outputs(v2, v3)\n";
    // 4 sequences of 8 tokens have 4 * 7 = 28 targets; each rank holds 2 sequences.
    assert_eq!(
        kernels(text, 1),
        vec![
            Kernel::CrossEntropy { batch: 2, seq: 8, vocab: 16, terms: 28 },
            Kernel::CrossEntropyGrad { batch: 2, seq: 8, vocab: 16, terms: 28 },
        ]
    );
}

#[test]
fn loss_on_a_sequence_block_is_refused() {
    let text = "; module m mesh=dp=2\n\
        v0: i32[batch=4, seq=8/dp] = tokens()   # n0 tokens\n\
        v1: f32[batch=4, seq=8/dp, vocab=16] = param() name=\"logits\"   # n1 logits\n\
        v2: f32[] partial(dp) = cross_entropy(v1, v0)   # n2 loss\n\
        outputs(v2)\n";
    let module = parse_module(text).expect("parses");
    let error = lower_rank(&module, 0).expect_err("the shift crosses the blocks");
    assert!(matches!(&error, Error::SplitLossDim { dim, local: 4, global: 8, .. } if dim == "seq"), "{error}");
    assert_eq!(
        error.to_string(),
        "loss: op cross_entropy needs seq whole on every rank, but this rank holds 4 of 8; \
         keep seq unsplit for the loss (split batch instead)"
    );
}

#[test]
fn attention_grads_map_split_query_heads_onto_whole_kv_heads() {
    // 6 query heads over 3 kv heads, the query heads split over tp=2 and the kv heads whole: rank 1
    // holds query heads 3..6, which read kv heads 1 and 2 of the 3 it holds.
    let q = "f32[batch=1, seq=4, heads=6/tp, head_dim=4]";
    let kv = "f32[batch=1, seq=4, kv_heads=3, head_dim=4]";
    let text = format!(
        "; module m mesh=tp=2\n\
         v0: i32[seq=4] = positions()   # n0 positions\n\
         v1: {q} = param() name=\"q\"   # n1 q\n\
         v2: {kv} = param() name=\"k\"   # n2 k\n\
         v3: {kv} = param() name=\"v\"   # n3 v\n\
         v4: {q} = param() name=\"dy\"   # n4 dy\n\
         v5: {q} = attention_grad_query(v1, v2, v3, v0, v0, v4) causal=true   # n5 dq\n\
         v6: {kv} partial(tp) = attention_grad_key(v1, v2, v3, v0, v0, v4) causal=true   # n6 dk\n\
         v7: {kv} partial(tp) = attention_grad_value(v1, v2, v3, v0, v0, v4) causal=true   # n7 dv\n\
         outputs(v5, v6, v7)\n"
    );
    let grad = |wrt| Kernel::AttentionGrad {
        wrt,
        dims: AttentionDims {
            batch: 1,
            sq: 4,
            sk: 4,
            hq: 3,
            hkv: 3,
            head_dim: 4,
            q_head_offset: 3,
            kv_head_offset: 0,
            group: 2,
            causal: true,
            scale: 0.5,
        },
    };
    assert_eq!(
        kernels(&text, 1),
        vec![grad(AttentionOperand::Query), grad(AttentionOperand::Key), grad(AttentionOperand::Value)]
    );
}

#[test]
fn embedding_grad_of_a_vocab_block_starts_at_its_offset() {
    let text = "; module m mesh=tp=2\n\
        v0: i32[batch=2, seq=4] = tokens()   # n0 tokens\n\
        v1: f32[batch=2, seq=4, hidden=8] = param() name=\"dy\"   # n1 dy\n\
        v2: f32[vocab=16/tp, hidden=8] = embedding_grad(v1, v0) vocab=16   # n2 grad.table\n\
        outputs(v2)\n";
    assert_eq!(kernels(text, 1), vec![Kernel::EmbeddingGrad { hidden: 8, vocab_offset: 8, vocab_total: 16 }]);
    assert_eq!(kernels(text, 0), vec![Kernel::EmbeddingGrad { hidden: 8, vocab_offset: 0, vocab_total: 16 }]);
}

#[test]
fn linear_grads_take_local_sizes() {
    // A column-parallel projection: the weight's heads split over tp, the activation whole.
    let text = "; module m mesh=tp=2\n\
        v0: f32[batch=2, seq=4, hidden=8] = param() name=\"x\"   # n0 x\n\
        v1: f32[heads=4/tp, head_dim=2, hidden=8] = param() name=\"w\"   # n1 w\n\
        v2: f32[batch=2, seq=4, heads=4/tp, head_dim=2] = param() name=\"dy\"   # n2 dy\n\
        v3: f32[batch=2, seq=4, hidden=8] partial(tp) = matmul_grad_input(v2, v1) contract=1   # n3 dx\n\
        v4: f32[heads=4/tp, head_dim=2, hidden=8] = matmul_grad_weight(v2, v0) contract=1   # n4 dw\n\
        v5: f32[hidden=8] = sum_leading(v0) keep=1   # n5 db\n\
        v6: f32[hidden=8] = rms_norm_grad_weight(v0, v0) eps=0.00001   # n6 dnorm\n\
        outputs(v3, v4, v5, v6)\n";
    assert_eq!(
        kernels(text, 0),
        vec![
            Kernel::MatMulGradInput { m: 8, n: 4, k: 8 },
            Kernel::MatMulGradWeight { m: 8, n: 4, k: 8 },
            Kernel::SumLeading { width: 8 },
            Kernel::RmsNormGradWeight { hidden: 8, eps: 0.00001 },
        ]
    );
}
