//! The pass manager: named passes run in order, with the verifier after each.
//!
//! A pass is a plain function over a `Module`. Pipelines are `const` slices of passes. The manager
//! runs the verifier after every pass when `PassCtx::verify_each` is set (always in tests), so a
//! broken pass is caught where it breaks, and it keeps the text of the IR after the passes the
//! caller asked to see (`pleat compile --dump-after PASS`): libraries do not print.

use std::time::{Duration, Instant};

use pleat_ir::{AxisName, Module};

use crate::error::{Error, Result};
use crate::verify::verify;

/// A named transformation of a module.
#[derive(Clone, Copy)]
pub struct Pass {
    /// The kebab-case name `--dump-after` takes.
    pub name: &'static str,
    /// The transformation.
    pub run: fn(&mut Module, &PassCtx) -> Result<()>,
}

impl std::fmt::Debug for Pass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name)
    }
}

/// Which passes' output to keep as text.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum Dump {
    /// None.
    #[default]
    Nothing,
    /// The passes with these names.
    After(Vec<String>),
    /// Every pass (snapshot tests).
    Every,
}

/// What passes may read besides the module.
#[derive(Clone, Debug)]
pub struct PassCtx {
    /// Run the verifier after every pass.
    pub verify_each: bool,
    /// What to dump.
    pub dump: Dump,
    /// Korthikanti et al.'s sequence parallelism on the `tp` axis: norms, residuals and the
    /// embedding output stay split on seq; reduce-scatter and all-gather replace all-reduce.
    pub sequence_parallel: bool,
    /// Under sequence parallelism, let `rewrite-collectives` fold the tp axis into TSP where moving
    /// the weights is cheaper than moving the tokens (the `fold-tp-sp-into-tsp` rule table).
    pub fold_into_tsp: bool,
    /// ZeRO's stage over the `dp` axis when training (0: plain data parallelism): 1 splits the
    /// optimizer state, 2 also the gradients (reduce-scattered), 3 also the parameters (gathered
    /// before each use).
    pub zero_stage: u8,
    /// Which forward values the backward recomputes instead of keeping.
    pub recompute: crate::autodiff::Recompute,
    /// Expert parallelism's token dispatcher: all-gather the tokens over `ep` and reduce-scatter
    /// the experts' pending sums (Megatron's `allgather` dispatcher) instead of sending each token
    /// to its experts' ranks and back (`alltoall`, the default).
    pub expert_all_gather: bool,
}

impl Default for PassCtx {
    fn default() -> Self {
        PassCtx {
            verify_each: true,
            dump: Dump::Nothing,
            sequence_parallel: false,
            fold_into_tsp: false,
            zero_stage: 0,
            recompute: crate::autodiff::Recompute::None,
            expert_all_gather: false,
        }
    }
}

impl PassCtx {
    /// Verify after each pass and dump every pass: what snapshot tests want.
    pub fn for_tests() -> PassCtx {
        PassCtx { dump: Dump::Every, ..PassCtx::default() }
    }
    fn wants_dump(&self, pass: &str) -> bool {
        match &self.dump {
            Dump::Nothing => false,
            Dump::Every => true,
            Dump::After(names) => names.iter().any(|name| name == pass),
        }
    }
}

/// What a pipeline run leaves besides the transformed module.
#[derive(Clone, Debug, Default)]
pub struct PipelineReport {
    /// `(pass, IR text after it)` for each pass the context asked to dump, in order.
    pub dumps: Vec<(&'static str, String)>,
    /// `(pass, wall time)` for every pass.
    pub timings: Vec<(&'static str, Duration)>,
}

/// Runs `passes` over `module` in order, verifying after each when asked.
pub fn run_pipeline(passes: &[Pass], module: &mut Module, ctx: &PassCtx) -> Result<PipelineReport> {
    if let Dump::After(names) = &ctx.dump {
        if let Some(unknown) = names.iter().find(|name| passes.iter().all(|pass| pass.name != name.as_str())) {
            return Err(Error::UnknownPass {
                pass: unknown.clone(),
                known: passes.iter().map(|pass| pass.name).collect(),
            });
        }
    }
    // An axis of one rank splits nothing; left in, passes would place collectives over one rank
    // on it (an ep dispatch's all-to-all, fold-tsp's broadcasts), or experts on it. (So does
    // Megatron SP over tp=1.)
    let unit_tp = module.mesh.axis(AxisName::Tp).is_some_and(|axis| axis.size == 1);
    let unsplit;
    let ctx = if ctx.sequence_parallel && unit_tp {
        unsplit = PassCtx { sequence_parallel: false, ..ctx.clone() };
        &unsplit
    } else {
        ctx
    };
    module.mesh = module.mesh.without_unit_axes();
    let mut report = PipelineReport::default();
    for pass in passes {
        let started = Instant::now();
        (pass.run)(module, ctx).map_err(|error| crate::degrees::narrow_offered_degrees(error, module, ctx))?;
        report.timings.push((pass.name, started.elapsed()));
        if ctx.verify_each {
            verify(module).map_err(|errors| Error::Verify { pass: pass.name, errors })?;
        }
        if ctx.wants_dump(pass.name) {
            report.dumps.push((pass.name, pleat_ir::text::print_module(module)));
        }
    }
    Ok(report)
}
