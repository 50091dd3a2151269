//! Pipelined training plans: the `pp` axis of `pleat run --train`.
//!
//! The training graph of one micro-batch is sharded over the mesh's other axes and differentiated
//! as without `pp`; each node is then placed in a stage by its layer (the embedding on the first
//! stage, the final norm, LM head and loss on the last), and `pleat_backend::pipeline` cuts every
//! rank's program into its stage's part and replays it in the schedule's order. Global rank
//! `s · inner + i` is stage `s` of inner rank `i`.

use anyhow::{bail, Result};
use pleat_backend::optimizer::{optimizer_layout, OptimizerLayout};
pub use pleat_backend::pipeline::stage_of_nodes;
use pleat_backend::pipeline::{pipeline_programs, Phase, PipelinePlan, ScheduleStep};
use pleat_backend::{Group, Instr, Program};
use pleat_ir::{AxisName, Mesh, Module};
use pleat_passes::pipeline::{parse_pp_layers, Phase as PlannedPhase, Schedule, ScheduleKind};

use crate::schedule::ScheduleName;

/// Each stage's steps under `schedule`, from the planner's schedules (`pleat schedule` draws the
/// same ones). Pipelined execution runs the schedules whose steps are whole forwards and
/// backwards on one model chunk a rank.
pub fn schedule_steps(schedule: ScheduleName, stages: u32, micro_batches: u32) -> Result<Vec<Vec<ScheduleStep>>> {
    let kind = match schedule {
        ScheduleName::Gpipe => ScheduleKind::GPipe,
        ScheduleName::OneFOneB => ScheduleKind::OneFOneB,
        ScheduleName::Interleaved | ScheduleName::ZbH1 => bail!(crate::usage::UsageError::TrainSchedule),
    };
    let schedule = Schedule::build(kind, stages, micro_batches)?;
    Ok(schedule
        .per_stage
        .iter()
        .map(|steps| {
            steps
                .iter()
                .map(|step| ScheduleStep {
                    micro_batch: step.micro_batch,
                    phase: if step.phase == PlannedPhase::Forward { Phase::Forward } else { Phase::Backward },
                })
                .collect()
        })
        .collect())
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

/// The pipelined programs and their optimizer layouts for `module` (one micro-batch, sharded over
/// the inner mesh, differentiated).
pub fn pipelined(
    module: &Module,
    stage_of: &[u32],
    schedule: &[Vec<ScheduleStep>],
    micro_batches: u32,
    zero: u8,
) -> Result<(Vec<Program>, Vec<OptimizerLayout>)> {
    let plan = PipelinePlan { stage_of, schedule, micro_batches };
    let programs = pipeline_programs(module, &plan)?;
    pleat_backend::verify_collectives(&programs)?;
    let inner = module.mesh.world_size() as u32;
    let world = Group { axis: "world".into(), ranks: (0..programs.len() as u32).collect() };
    let mut layouts = Vec::with_capacity(programs.len());
    for program in &programs {
        let (stage, inner_rank) = (program.rank / inner, program.rank % inner);
        let loaded: Vec<&str> = program
            .instructions
            .iter()
            .filter_map(|instr| match instr {
                Instr::LoadParam { name, .. } => Some(name.as_str()),
                _ => None,
            })
            .collect();
        let mut layout = optimizer_layout(module, inner_rank, zero)?;
        layout.params.retain(|param| loaded.contains(&param.name.as_str()));
        for param in &mut layout.params {
            if let Some(group) = &mut param.gather {
                group.ranks = group.ranks.iter().map(|&rank| stage * inner + rank).collect();
            }
        }
        layout.world = world.clone();
        layouts.push(layout);
    }
    Ok((programs, layouts))
}
