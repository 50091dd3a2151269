//! Every rule: it fires on a tiny expression and the e-graph then holds the expected form, and
//! both forms compute the same global tensor on random inputs in the multi-rank simulator, for an
//! axis of 2 and of 4 ranks.

use egg::{RecExpr, Runner};
use pleat_ir::{AxisName, DType, DimName, Mesh, ShardSpec, TensorType};

use super::super::analysis::{LayerAnalysis, LayerGraph};
use super::super::language::{LayerLang, LeafTable};
use super::super::simulate::{global, random_inputs, simulate};
use super::{LayerRewrite, RuleTable};

use DimName::*;

const BATCH: u64 = 2;
const SEQ: u64 = 8;
const HIDDEN: u64 = 8;
const FFN: u64 = 16;

fn ty(dims: &[(DimName, u64)]) -> TensorType {
    TensorType::new(DType::F32, dims)
}

fn stream() -> TensorType {
    ty(&[(Batch, BATCH), (Seq, SEQ), (Hidden, HIDDEN)])
}

fn split(rank: usize, dim: usize) -> ShardSpec {
    ShardSpec::replicated(rank).with_shard(dim, AxisName::Tp)
}

/// The leaves every case can use: `%x`/`%y` replicated activations, `%p`/`%q` partial sums,
/// `%xs`/`%ys` split on seq, `%xh` split on hidden, `%w` a norm weight, `%f`/`%fs` an ffn
/// activation whole / split on ffn, `%wd`/`%wds` a down-projection weight whole / split on ffn,
/// `%wg`/`%wgs` a gate weight whole / split on ffn.
fn leaves() -> LeafTable {
    let mut leaves = LeafTable::new();
    leaves.tensor("x", stream(), ShardSpec::replicated(3));
    leaves.tensor("y", stream(), ShardSpec::replicated(3));
    leaves.tensor("p", stream(), ShardSpec::replicated(3).with_partial(AxisName::Tp));
    leaves.tensor("q", stream(), ShardSpec::replicated(3).with_partial(AxisName::Tp));
    leaves.tensor("xs", stream(), split(3, 1));
    leaves.tensor("ys", stream(), split(3, 1));
    leaves.tensor("xh", stream(), split(3, 2));
    leaves.tensor("w", ty(&[(Hidden, HIDDEN)]), ShardSpec::replicated(1));
    let ffn = ty(&[(Batch, BATCH), (Seq, SEQ), (Ffn, FFN)]);
    leaves.tensor("f", ffn.clone(), ShardSpec::replicated(3));
    leaves.tensor("fs", ffn, split(3, 2));
    let down = ty(&[(Hidden, HIDDEN), (Ffn, FFN)]);
    leaves.tensor("wd", down.clone(), ShardSpec::replicated(2));
    leaves.tensor("wds", down, split(2, 1));
    let gate = ty(&[(Ffn, FFN), (Hidden, HIDDEN)]);
    leaves.tensor("wg", gate.clone(), ShardSpec::replicated(2));
    leaves.tensor("wgs", gate, split(2, 0));
    leaves
}

/// Leaves plus the attribute symbols the cases use (`eps=...`, `contract=1`).
fn leaves_with_attributes() -> LeafTable {
    let mut leaves = leaves();
    let mut scratch = RecExpr::default();
    let x = scratch.add(LayerLang::Symbol("%x".into()));
    let ops = [pleat_ir::Op::RmsNorm { eps: 1e-5 }, pleat_ir::Op::MatMul { contract: 1 }];
    for op in ops {
        super::super::language::push_op(&mut scratch, &mut leaves, &op, &[x, x]);
    }
    leaves
}

fn table_rules(table: RuleTable, name: &str) -> Vec<LayerRewrite> {
    let rules = table.rules().unwrap();
    let picked: Vec<LayerRewrite> = rules.into_iter().filter(|rule| rule.name.as_str() == name).collect();
    assert_eq!(picked.len(), 1, "table {} has no rule {name}", table.name());
    picked
}

/// Runs rule `name` of `table` on `start`; checks it fired, that `expected` is now in the start's
/// class, that no merge conflicted, and that both evaluate equal on 2 and 4 ranks.
fn check(table: RuleTable, name: &str, start: &str, expected: &str) {
    let rules = table_rules(table, name);
    let start: RecExpr<LayerLang> = start.parse().unwrap();
    let expected: RecExpr<LayerLang> = expected.parse().unwrap();
    for degree in [2, 4] {
        let mesh = Mesh::new(&[(AxisName::Tp, degree)]).unwrap();
        let leaves = leaves_with_attributes();
        let analysis = LayerAnalysis::new(mesh.clone(), leaves.clone());
        let egraph = LayerGraph::new(analysis.clone());
        let runner: Runner<LayerLang, LayerAnalysis> =
            Runner::new(analysis.clone()).with_egraph(egraph).with_expr(&start).with_iter_limit(5).run(&rules);
        let fired: usize = runner.iterations.iter().filter_map(|iteration| iteration.applied.get(&rules[0].name)).sum();
        assert!(fired > 0, "{name} did not fire on {start} (tp={degree})");
        assert!(runner.egraph.analysis.conflicts.is_empty(), "{name}: {:?}", runner.egraph.analysis.conflicts);
        let root = runner.egraph.find(runner.roots[0]);
        assert_eq!(
            runner.egraph.lookup_expr(&expected).map(|id| runner.egraph.find(id)),
            Some(root),
            "{name}: {expected} is not in the class of {start}"
        );
        for seed in 0..3 {
            let inputs = random_inputs(&leaves, &mesh, seed);
            let (left, left_meta) = simulate(&start, &leaves, &mesh, &inputs).unwrap();
            let (right, right_meta) = simulate(&expected, &leaves, &mesh, &inputs).unwrap();
            assert_eq!(left_meta.spec, right_meta.spec, "{name}: layouts differ");
            let (left, right) = (global(&left, &left_meta).unwrap(), global(&right, &right_meta).unwrap());
            let (at, diff) = left.max_abs_diff(&right).unwrap();
            assert!(diff <= 1e-5, "{name} (tp={degree}, seed {seed}): differ by {diff} at {at}");
        }
    }
}

#[test]
fn ag_then_slice_cancels() {
    check(RuleTable::Collectives, "ag-then-slice-cancels", "(local_slice tp seq (all_gather tp seq %xs))", "%xs");
}

#[test]
fn replicate_then_slice_is_noop() {
    check(RuleTable::Collectives, "replicate-then-slice-is-noop", "(all_gather tp seq (local_slice tp seq %x))", "%x");
}

#[test]
fn reshard_via_all_to_all() {
    check(
        RuleTable::Collectives,
        "reshard-via-all-to-all",
        "(local_slice tp hidden (all_gather tp seq %xs))",
        "(all_to_all tp hidden seq %xs)",
    );
}

#[test]
fn allreduce_of_sum_commutes() {
    check(
        RuleTable::Collectives,
        "allreduce-of-sum-commutes",
        "(add (all_reduce tp %p) (all_reduce tp %q))",
        "(all_reduce tp (add %p %q))",
    );
}

#[test]
fn row_linear_partial_sum() {
    check(
        RuleTable::Linear,
        "row-linear-partial-sum",
        "(matmul contract=1 (all_gather tp ffn %fs) (all_gather tp ffn %wds))",
        "(all_reduce tp (matmul contract=1 %fs %wds))",
    );
}

#[test]
fn column_linear_shard_out() {
    check(
        RuleTable::Linear,
        "column-linear-shard-out",
        "(matmul contract=1 %x (all_gather tp ffn %wgs))",
        "(all_gather tp ffn (matmul contract=1 %x %wgs))",
    );
}

#[test]
fn all_reduce_is_rs_then_ag() {
    check(
        RuleTable::SequenceParallel,
        "all-reduce-is-rs-then-ag",
        "(all_reduce tp %p)",
        "(all_gather tp seq (reduce_scatter tp seq %p))",
    );
}

#[test]
fn partial_then_reduce_scatter() {
    check(
        RuleTable::SequenceParallel,
        "partial-then-reduce-scatter",
        "(local_slice tp seq (all_reduce tp %p))",
        "(reduce_scatter tp seq %p)",
    );
}

#[test]
fn gather_commutes_with_norm() {
    check(
        RuleTable::SequenceParallel,
        "gather-commutes-with-norm",
        "(rms_norm eps=0.00001 (all_gather tp seq %xs) %w)",
        "(all_gather tp seq (rms_norm eps=0.00001 %xs %w))",
    );
}

#[test]
fn gather_commutes_with_add() {
    check(
        RuleTable::SequenceParallel,
        "gather-commutes-with-add",
        "(add (all_gather tp seq %xs) (all_gather tp seq %ys))",
        "(all_gather tp seq (add %xs %ys))",
    );
}

#[test]
fn slice_residual_to_meet_gather() {
    check(
        RuleTable::SequenceParallel,
        "slice-residual-to-meet-gather",
        "(add %x (all_gather tp seq %ys))",
        "(all_gather tp seq (add (local_slice tp seq %x) %ys))",
    );
    check(
        RuleTable::SequenceParallel,
        "slice-residual-to-meet-gather-rev",
        "(add (all_gather tp seq %ys) %x)",
        "(all_gather tp seq (add %ys (local_slice tp seq %x)))",
    );
}

/// The typing guard: a norm never commutes with a gather of the dim it normalizes, and a rule
/// never fires where its right side would be ill-typed or laid out differently.
#[test]
fn guarded_rules_do_not_fire_where_they_would_be_wrong() {
    let mesh = Mesh::new(&[(AxisName::Tp, 2)]).unwrap();
    let cases = [
        (
            RuleTable::SequenceParallel,
            "gather-commutes-with-norm",
            "(rms_norm eps=0.00001 (all_gather tp hidden %xh) %w)",
        ),
        // One dim: that is `ag-then-slice-cancels`, not an all-to-all.
        (RuleTable::Collectives, "reshard-via-all-to-all", "(local_slice tp seq (all_gather tp seq %xs))"),
        (RuleTable::Linear, "column-linear-shard-out", "(matmul contract=1 %x %wg)"),
    ];
    for (table, name, start) in cases {
        let rules = table_rules(table, name);
        let start: RecExpr<LayerLang> = start.parse().unwrap();
        let analysis = LayerAnalysis::new(mesh.clone(), leaves_with_attributes());
        let runner: Runner<LayerLang, LayerAnalysis> =
            Runner::new(analysis.clone()).with_egraph(LayerGraph::new(analysis)).with_expr(&start).run(&rules);
        let fired: usize = runner.iterations.iter().filter_map(|iteration| iteration.applied.get(&rules[0].name)).sum();
        assert_eq!(fired, 0, "{name} fired on {start}");
    }
}

/// A merge of differently laid-out classes is recorded, not a panic.
#[test]
fn a_bad_merge_is_a_recorded_conflict() {
    let mesh = Mesh::new(&[(AxisName::Tp, 2)]).unwrap();
    let mut egraph = LayerGraph::new(LayerAnalysis::new(mesh, leaves()));
    let whole = egraph.add_expr(&"%x".parse().unwrap());
    let sharded = egraph.add_expr(&"%xs".parse().unwrap());
    egraph.union(whole, sharded);
    egraph.rebuild();
    assert_eq!(egraph.analysis.conflicts.len(), 1);
    assert!(egraph.analysis.conflicts[0].right.contains("seq/tp"), "{:?}", egraph.analysis.conflicts);
}
