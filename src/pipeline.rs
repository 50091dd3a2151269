//! Pipelined training plans: the `pp` axis of `pleat run --train`.
//!
//! The training graph of one micro-batch is sharded over the mesh's other axes and differentiated
//! as without `pp`; each node is then placed in a stage by its layer (the embedding on the first
//! stage, the final norm, LM head and loss on the last), and `pleat_backend::pipeline` cuts every
//! rank's program into its stage's part and replays it in the schedule's order. Global rank
//! `s · inner + i` is stage `s` of inner rank `i`.

use anyhow::Result;
use pleat_backend::optimizer::{optimizer_layout, OptimizerLayout};
pub use pleat_backend::pipeline::stage_of_nodes;
use pleat_backend::pipeline::{pipeline_programs, Phase, PipelinePlan, ScheduleStep};
use pleat_backend::{Group, Instr, Program};
use pleat_ir::{AxisName, Mesh, Module};

/// The pipeline schedules pleat runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum ScheduleArg {
    /// Every micro-batch's forward, then every backward.
    Gpipe,
    /// PipeDream-flush: after a warm-up of (stages - stage - 1) forwards, one forward, one backward.
    #[default]
    #[value(name = "1f1b")]
    OneFOneB,
}

/// Each stage's steps under `schedule`.
pub fn schedule_steps(schedule: ScheduleArg, stages: u32, micro_batches: u32) -> Vec<Vec<ScheduleStep>> {
    let forward = |micro_batch| ScheduleStep { micro_batch, phase: Phase::Forward };
    let backward = |micro_batch| ScheduleStep { micro_batch, phase: Phase::Backward };
    (0..stages)
        .map(|stage| match schedule {
            ScheduleArg::Gpipe => (0..micro_batches).map(forward).chain((0..micro_batches).map(backward)).collect(),
            ScheduleArg::OneFOneB => {
                let warm_up = (stages - stage - 1).min(micro_batches);
                let mut steps: Vec<ScheduleStep> = (0..warm_up).map(forward).collect();
                for index in 0..micro_batches - warm_up {
                    steps.push(forward(warm_up + index));
                    steps.push(backward(index));
                }
                steps.extend((micro_batches - warm_up..micro_batches).map(backward));
                steps
            }
        })
        .collect()
}

/// Parses `--pp-layers 9,8,8,7`.
pub fn parse_pp_layers(text: &str) -> Result<Vec<u64>> {
    text.split(',')
        .map(|part| {
            part.trim()
                .parse::<u64>()
                .map_err(|_| anyhow::anyhow!("--pp-layers {text}: `{part}` is not a layer count; write e.g. 9,8,8,7"))
        })
        .collect()
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
