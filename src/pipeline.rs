//! Pipelined training plans: the `pp` axis of `pleat run --train`.
//!
//! The training graph of one micro-batch is sharded over the mesh's other axes and differentiated
//! as without `pp`; each node is then placed in a stage by its layer (the embedding on the first
//! stage, the final norm, LM head and loss on the last; the layers a stage balanced by the cost
//! model unless `--pp-layers` says), and `pleat_backend::pipeline` cuts every
//! rank's program into its stage's part and replays it in the schedule's order. Global rank
//! `s · inner + i` is stage `s` of inner rank `i`.

use anyhow::{bail, Result};
use clap::ValueEnum;
use pleat_backend::optimizer::{pipelined_optimizer_layout, OptimizerLayout};
pub use pleat_backend::pipeline::{gather_params_on_each_stage, stage_of_nodes};
use pleat_backend::pipeline::{pipeline_programs_with_spans, PipelinePlan, ScheduleStep, StepSpan};
use pleat_backend::Program;
use pleat_ir::model::config::ModelConfig;
use pleat_ir::{AxisName, Mesh, Module};
use pleat_passes::cost::{HardwareSpec, Layout, ModelShape, Workload};
use pleat_passes::pipeline::{parse_pp_layers, part_costs, Schedule, ScheduleKind};

use crate::schedule::ScheduleName;

/// The planner's schedule for `schedule` (`chunks` model chunks a rank for interleaved, which
/// needs at least 2; `None` takes 2).
pub fn schedule_kind(schedule: ScheduleName, chunks: Option<u32>) -> Result<ScheduleKind> {
    Ok(match (schedule, chunks) {
        (ScheduleName::Interleaved, chunks) => ScheduleKind::Interleaved { chunks: chunks.unwrap_or(2) },
        (other, Some(chunks)) => {
            let name = other.to_possible_value().map(|value| value.get_name().to_string()).unwrap_or_default();
            bail!(crate::usage::UsageError::ChunksWithoutInterleaving { chunks, schedule: name })
        }
        (ScheduleName::Gpipe, None) => ScheduleKind::GPipe,
        (ScheduleName::OneFOneB, None) => ScheduleKind::OneFOneB,
        (ScheduleName::ZbH1, None) => ScheduleKind::ZeroBubbleH1,
    })
}

/// Each pipeline rank's steps under `kind`, from the planner's schedules (`pleat schedule` draws
/// the same ones): every (micro-batch, chunk) forward, backward, or for ZB-H1 the backward's
/// input-gradient and weight-gradient parts.
pub fn schedule_steps(kind: ScheduleKind, stages: u32, micro_batches: u32) -> Result<Vec<Vec<ScheduleStep>>> {
    Ok(pleat_backend::pipeline::schedule_steps(&Schedule::build(kind, stages, micro_batches)?))
}

/// Layers a virtual stage by the cost model (the default split): each layer, the embedding on the
/// first stage and the LM head and loss on the last costed for one micro-batch of `(batch, seq)`
/// on the mesh inside a stage, on the CPU the threads runtime trains on.
pub fn cost_balanced_layers(
    config: &ModelConfig,
    inner: &Mesh,
    sequence_parallel: bool,
    (micro_batch, seq): (u64, u64),
    virtual_stages: u32,
) -> Result<Vec<u64>> {
    let model = ModelShape::from_config(config);
    let layout = Layout::from_mesh(inner, sequence_parallel);
    let hw = HardwareSpec::builtin("cpu")?;
    let costs = part_costs(&model, &layout, &Workload::training(seq, micro_batch), &hw);
    let ranges = pleat_passes::pipeline::cost_balanced_layers(&model, &costs, virtual_stages)?;
    Ok(ranges.iter().map(|range| u64::from(range.end - range.start)).collect())
}

/// `--pp-layers 9,8,8,7`: layers a stage, checked against the model and the stages.
pub fn layers_per_stage(text: &str, layers: u64, stages: u32) -> Result<Vec<u64>> {
    let ranges = parse_pp_layers(text, layers as u32, stages)?;
    Ok(ranges.iter().map(|range| u64::from(range.end - range.start)).collect())
}

/// The mesh inside a stage: `mesh` without its `pp` axis.
pub fn inner_mesh(mesh: &Mesh) -> Result<Mesh> {
    let axes: Vec<(AxisName, u64)> =
        mesh.axes().iter().filter(|axis| axis.name != AxisName::Pp).map(|axis| (axis.name, axis.size)).collect();
    Ok(Mesh::new(&axes)?)
}

/// Every pipeline rank's program, optimizer layout and schedule steps' spans, in global rank order.
pub type Pipelined = (Vec<Program>, Vec<OptimizerLayout>, Vec<Vec<StepSpan>>);

/// The pipelined programs and their optimizer layouts for `module` (one micro-batch, sharded over
/// the inner mesh, differentiated), `stage_of` giving each node's virtual stage.
pub fn pipelined(
    module: &Module,
    stage_of: &[u32],
    schedule: &[Vec<ScheduleStep>],
    (micro_batches, chunks): (u32, u32),
    zero: u8,
) -> Result<Pipelined> {
    let plan = PipelinePlan { stage_of, schedule, micro_batches, chunks };
    let (programs, spans): (Vec<Program>, Vec<Vec<StepSpan>>) =
        pipeline_programs_with_spans(module, &plan)?.into_iter().unzip();
    pleat_backend::verify_collectives(&programs)?;
    let world_size = programs.len() as u32;
    let layouts = programs
        .iter()
        .map(|program| pipelined_optimizer_layout(module, program, world_size, zero))
        .collect::<std::result::Result<Vec<_>, _>>()?;
    Ok((programs, layouts, spans))
}

/// Micro-batches a step when `--micro-batches` is not given: 2·pp (each stage busy with a second
/// while the first moves on), or the largest count below it that splits `batch` into micro-batches
/// whose sequences split over `batch_ranks` ranks ([`batch_axes`]).
pub fn default_micro_batches(batch: u64, stages: u32, batch_ranks: u64) -> u32 {
    let splits = |count: u64| batch % count == 0 && (batch / count) % batch_ranks.max(1) == 0;
    (1..=2 * stages).rev().find(|&count| splits(u64::from(count))).unwrap_or(1)
}

/// The axes of `mesh` above one rank that split the batch (`pleat_passes::strategy::BATCH_AXES`:
/// dp, and ep, which splits a mixture's batch as dp does).
pub fn batch_axes(mesh: &Mesh) -> Vec<AxisName> {
    pleat_passes::strategy::BATCH_AXES.into_iter().filter(|&axis| mesh.degree(axis) > 1).collect()
}

/// The ranks the batch splits over: the product of [`batch_axes`]' degrees.
pub fn batch_ranks(mesh: &Mesh) -> u64 {
    batch_axes(mesh).iter().map(|&axis| mesh.degree(axis)).product()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_micro_batches_split_over_the_batch_axes() {
        // 2·pp = 4 micro-batches of a batch of 8; over dp=4 each holds 2 sequences, which do not
        // split, so 2 micro-batches of 4; over dp=8 one of 8.
        assert_eq!(default_micro_batches(8, 2, 1), 4);
        assert_eq!(default_micro_batches(8, 2, 4), 2);
        assert_eq!(default_micro_batches(8, 2, 8), 1);
        // A batch of 6 over pp=4: 6 micro-batches; over dp=2 3 of 2.
        assert_eq!(default_micro_batches(6, 4, 1), 6);
        assert_eq!(default_micro_batches(6, 4, 2), 3);
        let mesh = Mesh::parse("pp=2,dp=2,tp=2,ep=1").unwrap();
        assert_eq!(batch_axes(&mesh), [AxisName::Dp]);
        assert_eq!(batch_ranks(&mesh), 2);
        assert_eq!(batch_axes(&Mesh::parse("dp=2,ep=4").unwrap()), [AxisName::Dp, AxisName::Ep]);
    }
}
