//! `fold-tp-sp-into-tsp`: move the weights instead of the activations.
//!
//! Under tensor parallelism with sequence parallelism one mesh axis already splits both the
//! weights (heads and ffn) and, between the blocks, the tokens (seq); each block all-gathers its
//! input's tokens and reduce-scatters its output's. These rules fold that pair of layouts into
//! TSP's single axis: the tokens stay split through the block and the weight blocks travel instead,
//! so a block's communication no longer grows with the tokens, only the gathered keys and values do.
//!
//! - `broadcast-weights-instead-of-gather-activations`: `reduce_scatter(seq, o_proj(attention(q, k,
//!   v)))` of the gathered input equals, summed over each owner j of the axis, the attention of the
//!   rank's own tokens computed with owner j's broadcast blocks of Wq, Wk, Wv and Wo, against keys
//!   and values all-gathered over the sequence, with the positions of the rank's own tokens for its
//!   queries (`broadcast_shard`, `local_slice` of the positions, `all_gather` of k and v). It sends
//!   (D-1)/D of the attention weights and (D-1)/D of the keys and values, instead of gathering and
//!   scattering the hidden states.
//! - `ring-weights-instead-of-gather-activations`: the gathered gated MLP, reduce-scattered, equals
//!   the ring MLP on the rank's own tokens (`ring_gated_mlp`: each rank applies the shard it holds
//!   while the shards move one hop around the axis), which sends (D-1)/D of the MLP weights.
//!
//! The right-hand sides are the forms `fold-tsp` writes for `--mesh tsp=D` (without the zigzag
//! token order, which only balances causal attention across ranks: every rank's queries carry
//! their absolute positions, so any split of the tokens is exact). Both rules type-check like any
//! other (`WellTyped`), so they fire only when the kv heads divide by the axis, and the cost model
//! keeps whichever form is cheaper. By volume, the MLP's ring wins once the tokens outweigh its
//! weights (2·B·S·h against 3·h·ffn, B·S > 6h at ffn = 4h); the attention's broadcasts only win
//! with grouped-query attention, whose gathered k/v are smaller than the hidden states they
//! replace by more than the attention weights (with as many kv heads as heads they are as large).
//! Together the folded layer sends the TSP paper's (D-1)/D·(16h² + 2BSh).
//!
//! The owners are unrolled, so the table is made for one axis degree, and the broadcast roots are
//! attribute leaves `root=j` that `declare_roots` adds to the layer's leaf table.

use pleat_ir::{AxisName, DimName, Op};

use super::{rule, LayerRewrite};
use crate::error::{Error, Result};
use crate::rewrite::language::LeafTable;

/// The name of the attention rule.
pub const ATTENTION_RULE: &str = "broadcast-weights-instead-of-gather-activations";
/// The name of the MLP rule.
pub const MLP_RULE: &str = "ring-weights-instead-of-gather-activations";

/// The spelling of owner `root`'s broadcast attribute.
fn root_symbol(root: u64) -> String {
    format!("root={root}")
}

/// Declares the broadcast roots `root=0` .. `root={degree-1}` in `leaves`, so the rules' patterns
/// can name them.
pub fn declare_roots(leaves: &mut LeafTable, degree: u64) -> Result<()> {
    for root in 0..degree {
        // Only `root` is read back from the attribute; the axis and dim come from the e-node.
        let op = Op::BroadcastShard { axis: AxisName::Tp, dim: DimName::Heads, root };
        let symbol = leaves.attribute(&op);
        if symbol.as_str() != root_symbol(root) {
            return Err(Error::RuleTable {
                rule: ATTENTION_RULE.to_string(),
                reason: format!("the layer already names another op {}", root_symbol(root)),
            });
        }
    }
    Ok(())
}

/// The gathered-input attention block of tensor parallelism with sequence parallelism.
const ATTENTION_LHS: &str = "(reduce_scatter ?a seq (matmul ?co (attention ?causal \
     (rope ?r (matmul ?c (all_gather ?a seq ?x) ?wq) ?p) \
     (rope ?r (matmul ?c (all_gather ?a seq ?x) ?wk) ?p) \
     (matmul ?c (all_gather ?a seq ?x) ?wv) ?p ?p) ?wo))";

/// Owner `root`'s share of the TSP attention on the rank's own tokens.
fn attention_of_owner(root: u64) -> String {
    let block = |weight: &str, dim: &str| format!("(broadcast_shard ?a {dim} {} {weight})", root_symbol(root));
    let local = "(local_slice ?a seq ?p)";
    let project = |weight: &str, dim: &str| format!("(matmul ?c ?x {})", block(weight, dim));
    let q = format!("(rope ?r {} {local})", project("?wq", "heads"));
    let k = format!("(all_gather ?a seq (rope ?r {} {local}))", project("?wk", "kv_heads"));
    let v = format!("(all_gather ?a seq {})", project("?wv", "kv_heads"));
    format!("(matmul ?co (attention ?causal {q} {k} {v} {local} ?p) {})", block("?wo", "heads"))
}

/// The sum over the owners, left to right: `(add (add o0 o1) o2)`.
fn attention_rhs(degree: u64) -> String {
    (1..degree).fold(attention_of_owner(0), |sum, root| format!("(add {sum} {})", attention_of_owner(root)))
}

/// The table's rules for an axis of `degree` ranks.
pub fn rules(degree: u64) -> Result<Vec<LayerRewrite>> {
    Ok(vec![
        rule(ATTENTION_RULE, ATTENTION_LHS, &attention_rhs(degree), None)?,
        rule(
            MLP_RULE,
            "(reduce_scatter ?a seq (matmul ?c (silu_mul \
               (matmul ?c (all_gather ?a seq ?x) ?g) (matmul ?c (all_gather ?a seq ?x) ?u)) ?d))",
            "(ring_gated_mlp ?a ?x ?g ?u ?d)",
            None,
        )?,
    ])
}

#[cfg(test)]
mod tests {
    use egg::{RecExpr, Runner};
    use pleat_ir::model::config::{RopeConfig, RopeScaling};
    use pleat_ir::{DType, Mesh, ShardSpec, TensorType};

    use super::*;
    use crate::rewrite::analysis::{LayerAnalysis, LayerGraph};
    use crate::rewrite::language::{push_op, LayerLang};
    use crate::rewrite::simulate::{global, random_inputs, simulate};

    use DimName::*;

    const HEAD_DIM: u64 = 4;
    const HIDDEN: u64 = 8;
    const FFN: u64 = 16;
    const HEADS: u64 = 4;

    /// The tp-sp layer's leaves: `%xs` the normed input split on seq, the weights split as
    /// tensor parallelism splits them, `%pos` the positions; and the ops' attribute symbols.
    fn leaves(kv_heads: u64, degree: u64) -> LeafTable {
        let mut leaves = LeafTable::new();
        let ty = |dims: &[(DimName, u64)]| TensorType::new(DType::F32, dims);
        let split = |rank: usize, dim: usize| ShardSpec::replicated(rank).with_shard(dim, AxisName::Tp);
        let stream = ty(&[(Batch, 2), (Seq, 8), (Hidden, HIDDEN)]);
        let x = leaves.tensor("xs", stream, split(3, 1));
        leaves.tensor("wq", ty(&[(Heads, HEADS), (HeadDim, HEAD_DIM), (Hidden, HIDDEN)]), split(3, 0));
        // kv heads that do not divide stay whole on every rank, as `strategy` seeds them.
        let kv_spec = if kv_heads % degree == 0 { split(3, 0) } else { ShardSpec::replicated(3) };
        leaves.tensor("wk", ty(&[(KvHeads, kv_heads), (HeadDim, HEAD_DIM), (Hidden, HIDDEN)]), kv_spec.clone());
        leaves.tensor("wv", ty(&[(KvHeads, kv_heads), (HeadDim, HEAD_DIM), (Hidden, HIDDEN)]), kv_spec);
        leaves.tensor("wo", ty(&[(Hidden, HIDDEN), (Heads, HEADS), (HeadDim, HEAD_DIM)]), split(3, 1));
        leaves.tensor("wg", ty(&[(Ffn, FFN), (Hidden, HIDDEN)]), split(2, 0));
        leaves.tensor("wu", ty(&[(Ffn, FFN), (Hidden, HIDDEN)]), split(2, 0));
        leaves.tensor("wd", ty(&[(Hidden, HIDDEN), (Ffn, FFN)]), split(2, 1));
        leaves.tensor("pos", TensorType::new(DType::I32, &[(Seq, 8)]), ShardSpec::replicated(1));
        let mut scratch = RecExpr::default();
        let x = scratch.add(LayerLang::Symbol(x));
        let rope = Op::Rope { rope: RopeConfig { theta: 10000.0, scaling: RopeScaling::None } };
        for op in [Op::MatMul { contract: 1 }, Op::MatMul { contract: 2 }, Op::Attention { causal: true }, rope] {
            push_op(&mut scratch, &mut leaves, &op, &[x; 5][..op_arity(&op)]);
        }
        declare_roots(&mut leaves, degree).unwrap();
        leaves
    }

    fn op_arity(op: &Op) -> usize {
        if matches!(op, Op::Attention { .. }) {
            5
        } else {
            2
        }
    }

    /// A pattern with its variables bound to the test's leaves and attributes.
    fn instantiate(pattern: &str) -> String {
        let bindings = [
            ("?causal", "causal=true"),
            ("?co", "contract=2"),
            ("?c", "contract=1"),
            ("?a", "tp"),
            ("?r", "theta=10000"),
            ("?x", "%xs"),
            ("?wq", "%wq"),
            ("?wk", "%wk"),
            ("?wv", "%wv"),
            ("?wo", "%wo"),
            ("?p", "%pos"),
            ("?g", "%wg"),
            ("?u", "%wu"),
            ("?d", "%wd"),
        ];
        let mut text = pattern.to_string();
        for (var, value) in bindings {
            text = text.split(var).collect::<Vec<_>>().join(value);
        }
        text
    }

    /// Runs the table on `start`; returns whether `expected` joined its class, after checking
    /// that both compute the same global tensor on random inputs (three seeds).
    fn fires(degree: u64, kv_heads: u64, rule_name: &str, start: &str, expected: &str) -> bool {
        let mesh = Mesh::new(&[(AxisName::Tp, degree)]).unwrap();
        let leaves = leaves(kv_heads, degree);
        let rules: Vec<LayerRewrite> =
            rules(degree).unwrap().into_iter().filter(|rule| rule.name.as_str() == rule_name).collect();
        let (start, expected): (RecExpr<LayerLang>, RecExpr<LayerLang>) =
            (start.parse().unwrap(), expected.parse().unwrap());
        let analysis = LayerAnalysis::new(mesh.clone(), leaves.clone());
        let runner: Runner<LayerLang, LayerAnalysis> = Runner::new(analysis.clone())
            .with_egraph(LayerGraph::new(analysis))
            .with_expr(&start)
            .with_iter_limit(3)
            .run(&rules);
        assert!(runner.egraph.analysis.conflicts.is_empty(), "{:?}", runner.egraph.analysis.conflicts);
        let joined = runner.egraph.lookup_expr(&expected).map(|id| runner.egraph.find(id))
            == Some(runner.egraph.find(runner.roots[0]));
        if joined {
            for seed in 0..3 {
                let inputs = random_inputs(&leaves, &mesh, seed);
                let (left, left_meta) = simulate(&start, &leaves, &mesh, &inputs).unwrap();
                let (right, right_meta) = simulate(&expected, &leaves, &mesh, &inputs).unwrap();
                assert_eq!(left_meta.spec, right_meta.spec, "{rule_name}: layouts differ");
                let (left, right) = (global(&left, &left_meta).unwrap(), global(&right, &right_meta).unwrap());
                let (at, diff) = left.max_abs_diff(&right).unwrap();
                assert!(diff <= 1e-5, "{rule_name} (tp={degree}, seed {seed}): differ by {diff} at {at}");
            }
        }
        joined
    }

    #[test]
    fn attention_broadcasts_weights_and_equals_the_gathered_form() {
        for degree in [2, 4] {
            let (start, expected) = (instantiate(ATTENTION_LHS), instantiate(&attention_rhs(degree)));
            assert!(fires(degree, HEADS, ATTENTION_RULE, &start, &expected), "tp={degree}");
        }
        // Grouped-query attention: two kv heads a rank's broadcast carries at tp=2.
        let (start, expected) = (instantiate(ATTENTION_LHS), instantiate(&attention_rhs(2)));
        assert!(fires(2, 2, ATTENTION_RULE, &start, &expected));
    }

    #[test]
    fn attention_stays_gathered_when_kv_heads_do_not_divide() {
        // Two kv heads on four ranks are whole on every rank: there is no block of them to
        // broadcast, so the typing guard refuses the rule.
        let (start, expected) = (instantiate(ATTENTION_LHS), instantiate(&attention_rhs(4)));
        assert!(!fires(4, 2, ATTENTION_RULE, &start, &expected));
    }

    #[test]
    fn mlp_ring_moves_weights_and_equals_the_gathered_form() {
        let start = instantiate(
            "(reduce_scatter ?a seq (matmul ?c (silu_mul \
               (matmul ?c (all_gather ?a seq ?x) ?g) (matmul ?c (all_gather ?a seq ?x) ?u)) ?d))",
        );
        for degree in [2, 4] {
            assert!(fires(degree, HEADS, MLP_RULE, &start, &instantiate("(ring_gated_mlp ?a ?x ?g ?u ?d)")));
        }
    }
}
