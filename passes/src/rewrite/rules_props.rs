//! Property tests of the rewrite rules: on random sizes, axis degrees, dims and input seeds, every
//! rule of every table fires on an instance of its left side, puts its right side in the same
//! e-class, and both sides compute the same global tensor in the multi-rank simulator (within
//! 1e-5). `rules::tests` checks the same on one fixed size with three seeds; this generalises it.

use egg::{RecExpr, Runner};
use pleat_ir::{AxisName, DType, DimName, Mesh, ShardSpec, TensorType};
use proptest::prelude::*;

use super::analysis::{LayerAnalysis, LayerGraph};
use super::language::{push_op, LayerLang, LeafTable};
use super::rules::{LayerRewrite, RuleTable};
use super::simulate::{global, random_inputs, simulate};

const TABLES: [RuleTable; 3] = [RuleTable::Collectives, RuleTable::Linear, RuleTable::SequenceParallel];

/// The dims of the residual stream `[batch, seq, hidden]`, which the collective rules may gather,
/// slice or scatter.
const STREAM_DIMS: [DimName; 3] = [DimName::Batch, DimName::Seq, DimName::Hidden];

/// One random instance: the tp degree, the sizes (each a multiple of the degree, so every dim can
/// be split), the dims the dim-generic rules use and the inputs' seed.
#[derive(Clone, Debug)]
struct Instance {
    degree: u64,
    batch: u64,
    seq: u64,
    hidden: u64,
    ffn: u64,
    /// A stream dim, by index into `STREAM_DIMS`.
    dim: usize,
    /// Another stream dim, offset from `dim` by 1 or 2.
    other_offset: usize,
    seed: u64,
}

impl Instance {
    fn dim(&self) -> DimName {
        STREAM_DIMS[self.dim]
    }
    fn other_dim(&self) -> DimName {
        STREAM_DIMS[(self.dim + self.other_offset) % STREAM_DIMS.len()]
    }
    /// A stream dim that `rms_norm` does not reduce over (not `hidden`).
    fn unnormalized_dim(&self) -> DimName {
        if self.dim() == DimName::Hidden {
            self.other_dim()
        } else {
            self.dim()
        }
    }
}

fn instances() -> impl Strategy<Value = Instance> {
    (
        prop::sample::select(vec![2u64, 3, 4, 8]),
        (1u64..=3, 1u64..=3, 1u64..=3, 1u64..=2),
        0usize..3,
        1usize..3,
        any::<u64>(),
    )
        .prop_map(|(degree, (batch, seq, hidden, ffn), dim, other_offset, seed)| Instance {
            degree,
            batch: batch * degree,
            seq: seq * degree,
            hidden: hidden * degree,
            ffn: ffn * degree,
            dim,
            other_offset,
            seed,
        })
}

fn ty(dims: &[(DimName, u64)]) -> TensorType {
    TensorType::new(DType::F32, dims)
}

fn split(rank: usize, dim: usize) -> ShardSpec {
    ShardSpec::replicated(rank).with_shard(dim, AxisName::Tp)
}

/// The leaf name of a stream tensor split on `dim`: `x_seq`, `y_hidden`.
fn split_leaf(base: &str, dim: DimName) -> String {
    format!("%{base}_{}", dim.as_str())
}

/// The leaves the cases use: `%x`/`%y` replicated activations, `%p`/`%q` partial sums, `%x_D`/`%y_D`
/// split on each stream dim `D`, `%w` a norm weight, `%f`/`%fs` an ffn activation whole / split on
/// ffn, `%wds` a down-projection weight split on ffn, `%wgs` a gate weight split on ffn; and the
/// attribute symbols `eps=0.00001` and `contract=1`.
fn leaves(instance: &Instance) -> LeafTable {
    let stream =
        ty(&[(DimName::Batch, instance.batch), (DimName::Seq, instance.seq), (DimName::Hidden, instance.hidden)]);
    let mut leaves = LeafTable::new();
    leaves.tensor("x", stream.clone(), ShardSpec::replicated(3));
    leaves.tensor("y", stream.clone(), ShardSpec::replicated(3));
    leaves.tensor("p", stream.clone(), ShardSpec::replicated(3).with_partial(AxisName::Tp));
    leaves.tensor("q", stream.clone(), ShardSpec::replicated(3).with_partial(AxisName::Tp));
    for (index, dim) in STREAM_DIMS.into_iter().enumerate() {
        for base in ["x", "y"] {
            leaves.tensor(&split_leaf(base, dim)[1..], stream.clone(), split(3, index));
        }
    }
    leaves.tensor("w", ty(&[(DimName::Hidden, instance.hidden)]), ShardSpec::replicated(1));
    let ffn = ty(&[(DimName::Batch, instance.batch), (DimName::Seq, instance.seq), (DimName::Ffn, instance.ffn)]);
    leaves.tensor("f", ffn.clone(), ShardSpec::replicated(3));
    leaves.tensor("fs", ffn, split(3, 2));
    leaves.tensor("wds", ty(&[(DimName::Hidden, instance.hidden), (DimName::Ffn, instance.ffn)]), split(2, 1));
    leaves.tensor("wgs", ty(&[(DimName::Ffn, instance.ffn), (DimName::Hidden, instance.hidden)]), split(2, 0));
    let mut scratch = RecExpr::default();
    let x = scratch.add(LayerLang::Symbol("%x".into()));
    for op in [pleat_ir::Op::RmsNorm { eps: 1e-5 }, pleat_ir::Op::MatMul { contract: 1 }] {
        push_op(&mut scratch, &mut leaves, &op, &[x, x]);
    }
    leaves
}

/// Every rule's `(name, table, left side, right side)` on `instance`'s dims.
fn cases(instance: &Instance) -> Vec<(&'static str, RuleTable, String, String)> {
    let (d, e, n) = (instance.dim().as_str(), instance.other_dim().as_str(), instance.unnormalized_dim().as_str());
    let (xd, yd, xn) = (
        split_leaf("x", instance.dim()),
        split_leaf("y", instance.dim()),
        split_leaf("x", instance.unnormalized_dim()),
    );
    use RuleTable::*;
    vec![
        ("ag-then-slice-cancels", Collectives, format!("(local_slice tp {d} (all_gather tp {d} {xd}))"), xd.clone()),
        (
            "replicate-then-slice-is-noop",
            Collectives,
            format!("(all_gather tp {d} (local_slice tp {d} %x))"),
            "%x".into(),
        ),
        (
            "reshard-via-all-to-all",
            Collectives,
            format!("(local_slice tp {e} (all_gather tp {d} {xd}))"),
            format!("(all_to_all tp {e} {d} {xd})"),
        ),
        (
            "allreduce-of-sum-commutes",
            Collectives,
            "(add (all_reduce tp %p) (all_reduce tp %q))".into(),
            "(all_reduce tp (add %p %q))".into(),
        ),
        (
            "row-linear-partial-sum",
            Linear,
            "(matmul contract=1 (all_gather tp ffn %fs) (all_gather tp ffn %wds))".into(),
            "(all_reduce tp (matmul contract=1 %fs %wds))".into(),
        ),
        (
            "column-linear-shard-out",
            Linear,
            "(matmul contract=1 %x (all_gather tp ffn %wgs))".into(),
            "(all_gather tp ffn (matmul contract=1 %x %wgs))".into(),
        ),
        (
            "all-reduce-is-rs-then-ag",
            SequenceParallel,
            "(all_reduce tp %p)".into(),
            "(all_gather tp seq (reduce_scatter tp seq %p))".into(),
        ),
        (
            "partial-then-reduce-scatter",
            SequenceParallel,
            format!("(local_slice tp {d} (all_reduce tp %p))"),
            format!("(reduce_scatter tp {d} %p)"),
        ),
        (
            "gather-commutes-with-norm",
            SequenceParallel,
            format!("(rms_norm eps=0.00001 (all_gather tp {n} {xn}) %w)"),
            format!("(all_gather tp {n} (rms_norm eps=0.00001 {xn} %w))"),
        ),
        (
            "gather-commutes-with-add",
            SequenceParallel,
            format!("(add (all_gather tp {d} {xd}) (all_gather tp {d} {yd}))"),
            format!("(all_gather tp {d} (add {xd} {yd}))"),
        ),
        (
            "slice-residual-to-meet-gather",
            SequenceParallel,
            format!("(add %x (all_gather tp {d} {yd}))"),
            format!("(all_gather tp {d} (add (local_slice tp {d} %x) {yd}))"),
        ),
        (
            "slice-residual-to-meet-gather-rev",
            SequenceParallel,
            format!("(add (all_gather tp {d} {yd}) %x)"),
            format!("(all_gather tp {d} (add {yd} (local_slice tp {d} %x)))"),
        ),
    ]
}

fn rule(table: RuleTable, name: &str) -> Result<LayerRewrite, TestCaseError> {
    let rules = table.rules().map_err(|error| TestCaseError::fail(error.to_string()))?;
    rules
        .into_iter()
        .find(|rule| rule.name.as_str() == name)
        .ok_or_else(|| TestCaseError::fail(format!("table {} has no rule {name}", table.name())))
}

/// Runs rule `name` alone on `start`: it must fire, put `expected` in the start's class without a
/// conflict, and both sides must compute equal global tensors on `instance`'s inputs.
fn check_rule(
    instance: &Instance,
    name: &str,
    table: RuleTable,
    start: &str,
    expected: &str,
) -> Result<(), TestCaseError> {
    let rules = vec![rule(table, name)?];
    let start: RecExpr<LayerLang> = start.parse().map_err(|error| TestCaseError::fail(format!("{start}: {error}")))?;
    let expected: RecExpr<LayerLang> =
        expected.parse().map_err(|error| TestCaseError::fail(format!("{expected}: {error}")))?;
    let mesh = Mesh::new(&[(AxisName::Tp, instance.degree)]).map_err(|error| TestCaseError::fail(error.to_string()))?;
    let leaves = leaves(instance);
    let analysis = LayerAnalysis::new(mesh.clone(), leaves.clone());
    let runner: Runner<LayerLang, LayerAnalysis> = Runner::new(analysis.clone())
        .with_egraph(LayerGraph::new(analysis))
        .with_expr(&start)
        .with_iter_limit(5)
        .run(&rules);
    let fired: usize = runner.iterations.iter().filter_map(|iteration| iteration.applied.get(&rules[0].name)).sum();
    prop_assert!(fired > 0, "{} did not fire on {}", name, start);
    prop_assert!(runner.egraph.analysis.conflicts.is_empty(), "{}: {:?}", name, runner.egraph.analysis.conflicts);
    let root = runner.egraph.find(runner.roots[0]);
    prop_assert_eq!(
        runner.egraph.lookup_expr(&expected).map(|id| runner.egraph.find(id)),
        Some(root),
        "{}: {} is not in the class of {}",
        name,
        expected,
        start
    );
    let inputs = random_inputs(&leaves, &mesh, instance.seed);
    let simulated = |expr: &RecExpr<LayerLang>| {
        let (locals, meta) =
            simulate(expr, &leaves, &mesh, &inputs).map_err(|error| TestCaseError::fail(format!("{expr}: {error}")))?;
        let whole = global(&locals, &meta).map_err(|error| TestCaseError::fail(format!("{expr}: {error}")))?;
        Ok::<_, TestCaseError>((whole, meta))
    };
    let (left, left_meta) = simulated(&start)?;
    let (right, right_meta) = simulated(&expected)?;
    prop_assert_eq!(&left_meta.spec, &right_meta.spec, "{}: layouts differ", name);
    let (at, diff) = left
        .max_abs_diff(&right)
        .ok_or_else(|| TestCaseError::fail(format!("{name}: the sides have different shapes")))?;
    prop_assert!(diff <= 1e-5, "{}: the sides differ by {} at {}", name, diff, at);
    Ok(())
}

/// The property covers every rule the tables hold: a new rule needs a case here.
#[test]
fn every_rule_has_a_property_case() {
    let instance = Instance { degree: 2, batch: 2, seq: 2, hidden: 2, ffn: 2, dim: 0, other_offset: 1, seed: 0 };
    let covered: Vec<&str> = cases(&instance).iter().map(|case| case.0).collect();
    for table in TABLES {
        for rule in table.rules().unwrap() {
            assert!(covered.contains(&rule.name.as_str()), "rule {} of table {} has no case", rule.name, table.name());
        }
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, failure_persistence: None, ..ProptestConfig::default() })]

    /// Both sides of every rule agree numerically on random sizes, degrees, dims and seeds.
    #[test]
    fn both_sides_of_every_rule_compute_the_same_tensor(instance in instances()) {
        for (name, table, start, expected) in cases(&instance) {
            check_rule(&instance, name, table, &start, &expected)?;
        }
    }
}
