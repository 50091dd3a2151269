//! The degrees of a mesh axis that every check on it accepts, so that an error offers only those.
//!
//! Each check that refuses an axis's degree sees one dimension: the heads, the sequence's zigzag
//! chunks, the batch. The degrees it offers divide that dimension, and a later check may refuse
//! them for another (tsp=3 splits seq=6 into zigzag chunks but not 4 kv heads). When a pass fails
//! on an axis's degree, the pass manager narrows the degrees its error offers to the divisors of
//! [`accepted_gcd`], the gcd of every count the axis must divide under the context's strategy.

use pleat_ir::{AxisName, DimName, Module};

use crate::error::Error;
use crate::manager::PassCtx;
use crate::strategy::{gcd, has_experts, token_values, weight_split_gcd, BATCH_AXES};

/// The gcd of every count a degree of `axis` must divide on `module`'s graph under `ctx`, the
/// mesh's other axes at their degrees: `None` when the axis has no strategy here.
/// - tp: its weight splits (heads, ffn, vocab; not kv heads, which may stay whole), and under
///   sequence parallelism a cp rank's sequence.
/// - tsp: its weight splits (kv heads too), half the sequence (two zigzag chunks a rank), and the
///   routed experts when no ep axis places them.
/// - cp: half the sequence.
/// - dp and ep: a rank's share of the batch over the other batch axis; ep also the experts.
pub fn accepted_gcd(module: &Module, ctx: &PassCtx, axis: AxisName) -> Option<u64> {
    let graph = &module.graph;
    let tokens = token_values(graph);
    let token_dim = |dim: DimName| tokens.first().and_then(|&value| graph.value(value).ty.shape.size_of(dim));
    // Two zigzag chunks a rank: 2·degree must divide seq, so the degree divides seq / 2.
    let zigzag = token_dim(DimName::Seq).map_or(0, |seq| if seq % 2 == 0 { seq / 2 } else { 1 });
    let experts = || {
        graph
            .params()
            .into_iter()
            .filter_map(|(value, _)| graph.value(value).ty.shape.size_of(DimName::Experts))
            .fold(0, gcd)
    };
    let count = match axis {
        AxisName::Tp => {
            // Beside cp, tp splits a cp rank's tokens.
            let cp = module.mesh.degree(AxisName::Cp);
            let seq = match token_dim(DimName::Seq) {
                Some(seq) if ctx.sequence_parallel && seq % cp == 0 => seq / cp,
                Some(seq) if ctx.sequence_parallel => seq,
                _ => 0,
            };
            gcd(weight_split_gcd(graph, axis), seq)
        }
        AxisName::Tsp => {
            let placed_experts =
                if module.mesh.degree(AxisName::Ep) == 1 && has_experts(graph) { experts() } else { 0 };
            gcd(gcd(weight_split_gcd(graph, axis), zigzag), placed_experts)
        }
        AxisName::Cp => zigzag,
        AxisName::Dp | AxisName::Ep => {
            let others: u64 =
                BATCH_AXES.iter().filter(|&&other| other != axis).map(|&other| module.mesh.degree(other)).product();
            let batch = token_dim(DimName::Batch).unwrap_or(0);
            // Where the other batch axes do not divide the batch, only this axis's degree 1 does not
            // add to the split.
            let share = if batch % others == 0 { batch / others } else { 1 };
            if axis == AxisName::Ep {
                gcd(share, experts())
            } else {
                share
            }
        }
        _ => return None,
    };
    Some(count)
}

/// `error` with the degrees it offers for an axis narrowed to those [`accepted_gcd`] accepts
/// (`module` as the failing pass left it: the checks read only the shapes of its params and
/// tokens, which passes do not change).
pub(crate) fn narrow_offered_degrees(mut error: Error, module: &Module, ctx: &PassCtx) -> Error {
    let (axis, valid) = match &mut error {
        Error::Ir(pleat_ir::Error::Indivisible { axis, valid, .. }) => (axis.as_str(), valid),
        Error::ZigzagSeq { axis, valid, .. } => (axis.as_str(), valid),
        _ => return error,
    };
    let accepted = AxisName::parse(axis).and_then(|axis| accepted_gcd(module, ctx, axis));
    // A count of 0 means no check on that axis: every degree stays offered.
    if let Some(accepted) = accepted.filter(|&accepted| accepted > 0) {
        valid.retain(|degree| accepted % degree == 0);
    }
    error
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::config::ModelConfig;
    use pleat_ir::Mesh;

    fn module(config: &ModelConfig, mesh: &str, batch: u64, seq: u64) -> Module {
        let mut module = pleat_ir::model::build(config, batch, seq).expect("builds");
        module.mesh = Mesh::parse(mesh).expect("mesh");
        module
    }

    fn offered(config: &str, mesh: &str, batch: u64, seq: u64, ctx: &PassCtx) -> Result<(), Error> {
        let config = pleat_ir::model::preset::preset(config).expect("preset");
        let mut module = module(&config, mesh, batch, seq);
        crate::run_pipeline(crate::SHARD_PIPELINE, &mut module, ctx).map(|_| ())
    }

    fn valid(error: &Error) -> Vec<u64> {
        match error {
            Error::Ir(pleat_ir::Error::Indivisible { valid, .. }) | Error::ZigzagSeq { valid, .. } => valid.clone(),
            other => panic!("not a degree error: {other}"),
        }
    }

    #[test]
    fn offered_degrees_pass_every_check_on_the_axis() {
        // tiny: 8 heads, 4 kv heads, ffn 64, vocab 256. Each case's first failing check sees one
        // dimension; the degrees offered must pass all of them, and do: each is compiled.
        let sp = PassCtx { sequence_parallel: true, ..PassCtx::default() };
        // (model, mesh, batch, seq, context, the degrees offered)
        type Case<'a> = (&'a str, &'a str, u64, u64, &'a PassCtx, &'a [u64]);
        let cases: [Case; 6] = [
            // seq 6 makes zigzag chunks at tsp 1 and 3; 4 kv heads leave 1 alone.
            ("tiny", "tsp=4", 8, 6, &PassCtx::default(), &[1]),
            ("tiny", "tsp=3", 8, 6, &PassCtx::default(), &[1]),
            // 6 tokens split over tp in {1,2,3,6}; 8 heads over {1,2,4,8}.
            ("tiny", "tp=4", 8, 6, &sp, &[1, 2]),
            ("tiny", "tp=3", 8, 6, &sp, &[1, 2]),
            // A rank's share of 2 sequences over dp=2 is 1.
            ("tiny-moe", "dp=2,ep=2", 2, 8, &PassCtx::default(), &[1]),
            ("tiny-moe", "ep=2,dp=2", 2, 8, &PassCtx::default(), &[1]),
        ];
        for (config, mesh, batch, seq, ctx, expected) in cases {
            let error = offered(config, mesh, batch, seq, ctx).expect_err(mesh);
            assert_eq!(valid(&error), expected, "{config} {mesh} batch {batch} seq {seq}: {error}");
            let axis = match &error {
                Error::Ir(pleat_ir::Error::Indivisible { axis, .. }) | Error::ZigzagSeq { axis, .. } => axis.clone(),
                _ => unreachable!(),
            };
            let bad = Mesh::parse(mesh).unwrap().axis(AxisName::parse(&axis).unwrap()).unwrap().size;
            for &degree in expected {
                let fixed = mesh.replace(&format!("{axis}={bad}"), &format!("{axis}={degree}"));
                offered(config, &fixed, batch, seq, ctx).unwrap_or_else(|error| panic!("{fixed}: {error}"));
            }
        }
    }
}
