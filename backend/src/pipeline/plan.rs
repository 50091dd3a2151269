//! Where a pipelined module's nodes go and whether a schedule can be replayed: each node's
//! virtual stage from its layer ([`stage_of_nodes`]), the phases a schedule uses, and the check
//! that every rank runs every (micro-batch, chunk) once in each phase.
//!
//! Guarantee: a plan these checks accept names every node's stage in range and every step once;
//! anything else is an `Error::Pipeline` that says what is wrong.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use pleat_ir::model::builder::layer_of;
use pleat_ir::{Graph, Module, NodeId, ValueId};

use super::{malformed, Phase, PipelinePlan, ScheduleStep};
use crate::error::Result;

/// The stage of every node of `module`, in program order: layers split into `stages` contiguous
/// runs (`layers_per_stage`, or as even as they go, earlier stages taking the remainder).
pub fn stage_of_nodes(module: &Module, stages: u32, layers_per_stage: Option<&[u64]>, layers: u64) -> Result<Vec<u32>> {
    let stages = stages.max(1);
    if layers_per_stage.is_none() && layers < u64::from(stages) {
        return Err(malformed(format!(
            "pp={stages} needs at least one layer a stage, and the model has {layers} layer{}; use pp <= {layers}",
            if layers == 1 { "" } else { "s" }
        )));
    }
    let counts: Vec<u64> = match layers_per_stage {
        Some(counts) => counts.to_vec(),
        None => (0..u64::from(stages))
            .map(|stage| layers / u64::from(stages) + u64::from(stage < layers % u64::from(stages)))
            .collect(),
    };
    if counts.len() != stages as usize || counts.iter().sum::<u64>() != layers || counts.contains(&0) {
        return Err(malformed(format!(
            "--pp-layers {counts:?} must give each of the {stages} stages at least one layer and sum to the model's \
             {layers} layers"
        )));
    }
    let mut layer_stage = Vec::new();
    for (stage, &count) in counts.iter().enumerate() {
        layer_stage.extend(std::iter::repeat_n(stage as u32, count as usize));
    }
    let last = stages - 1;
    let graph = &module.graph;
    let mut stage_of = graph
        .order()
        .iter()
        .map(|&node| {
            let name = graph.node(node).name.as_str();
            if let Some(layer) = layer_of(name) {
                return layer_stage
                    .get(layer as usize)
                    .copied()
                    .ok_or_else(|| malformed(format!("node `{name}` names layer {layer} of a {layers}-layer model")));
            }
            let bare = name.strip_prefix("grad.").unwrap_or(name);
            let first = ["embed", "model.embed_tokens", "tokens", "positions"];
            // The load-balancing loss sums every layer's statistics beside the loss.
            let final_stage = ["final_norm", "model.norm", "lm_head", "loss", "logits", "aux."];
            if first.iter().any(|prefix| bare.starts_with(prefix)) {
                Ok(0)
            } else if final_stage.iter().any(|prefix| bare.starts_with(prefix)) {
                Ok(last)
            } else {
                Err(malformed(format!(
                    "cannot place node `{name}` in a pipeline stage: it belongs to no layer, embedding or head"
                )))
            }
        })
        .collect::<Result<Vec<u32>>>()?;
    move_param_gathers_to_readers(module, &mut stage_of);
    Ok(stage_of)
}

/// Gives every stage that reads a parameter's gather (ZeRO-3's) beside the gather's own its own
/// gather of the rank's shard, just before its first reader there, and returns how many it added
/// (the caller places the nodes again with [`stage_of_nodes`]). A tied table's forward gather is
/// read by the embedding on the first stage and the LM head on the last: the last then receives
/// the shard once a step and gathers it itself, instead of receiving the whole gathered table every
/// micro-batch, which the first stage would hold to each micro-batch's end (another rank reads it
/// last).
pub fn gather_params_on_each_stage(module: &mut Module, stage_of: &[u32]) -> usize {
    let graph = &mut module.graph;
    let order = graph.order().to_vec();
    let mut added = 0;
    for (at, &node) in order.iter().enumerate() {
        if !graph.gathers_param(graph.node(node)) {
            continue;
        }
        let gathered = graph.node(node).result;
        let mut readers: BTreeMap<u32, Vec<NodeId>> = BTreeMap::new();
        for (reader_at, &reader) in order.iter().enumerate().skip(at + 1) {
            if graph.node(reader).inputs.contains(&gathered) {
                readers.entry(stage_of[reader_at]).or_default().push(reader);
            }
        }
        let own = stage_of[at];
        for (stage, nodes) in readers.into_iter().filter(|&(stage, _)| stage != own) {
            let first = graph.order().iter().position(|&id| id == nodes[0]).expect("a reader in the order");
            let anchor = graph.order()[first - 1];
            let copy = copy_param_gather(graph, node, anchor, stage, &mut added);
            for reader in nodes {
                for input in graph.node_mut(reader).inputs.iter_mut().filter(|input| **input == gathered) {
                    *input = copy;
                }
            }
        }
    }
    added
}

/// Inserts after `anchor` a copy of the parameter gather `node` for `stage`, and before it copies
/// of the gathers it reads (over dp × ep it reads the ep gather of the shard), so that the stage
/// starts from the shard; returns the copy's value and counts the nodes in `added`.
fn copy_param_gather(graph: &mut Graph, node: NodeId, anchor: NodeId, stage: u32, added: &mut usize) -> ValueId {
    let data = graph.node(node).clone();
    let input_def = graph.value(data.inputs[0]).def;
    let (input, anchor) = if graph.gathers_param(graph.node(input_def)) {
        let input = copy_param_gather(graph, input_def, anchor, stage, added);
        (input, graph.value(input).def)
    } else {
        (data.inputs[0], anchor)
    };
    let value = graph.value(data.result).clone();
    let name = format!("{}.stage{stage}", data.name);
    *added += 1;
    graph.insert_after(anchor, data.op, &[input], value.ty, value.spec, &name)
}

/// Moves each gather of a parameter (ZeRO-3's) whose readers all lie on one other stage to that
/// stage, which then gathers the rank's shard itself (the shard is sent once a step, as a tied
/// head's table is). A tied table's gather for the backward is one: placed by its name on the
/// first stage, it would run in that stage's backward, after the last stage's backward that
/// reads it, and the two would wait on each other.
fn move_param_gathers_to_readers(module: &Module, stage_of: &mut [u32]) {
    let graph = &module.graph;
    let order = graph.order();
    let gathers: Vec<(ValueId, usize)> = order
        .iter()
        .enumerate()
        .filter(|&(_, &node)| graph.gathers_param(graph.node(node)))
        .map(|(at, &node)| (graph.node(node).result, at))
        .collect();
    let mut readers: HashMap<ValueId, Vec<usize>> =
        gathers.iter().map(|&(gathered, _)| (gathered, Vec::new())).collect();
    for (at, &node) in order.iter().enumerate() {
        for input in graph.node(node).inputs.iter() {
            if let Some(positions) = readers.get_mut(input) {
                positions.push(at);
            }
        }
    }
    // Last first: over dp × ep the gather of the ep gather moves before the ep gather asks where
    // its reader is.
    for &(gathered, at) in gathers.iter().rev() {
        let stages: BTreeSet<u32> = readers[&gathered].iter().map(|&reader| stage_of[reader]).collect();
        if let Some(&stage) = stages.first().filter(|_| stages.len() == 1) {
            stage_of[at] = stage;
        }
    }
}

/// The phases a schedule's steps use: `[Forward, Backward]`, or the zero-bubble split.
pub(super) fn phases_of(plan: &PipelinePlan) -> Result<&'static [Phase]> {
    const WHOLE: &[Phase] = &[Phase::Forward, Phase::Backward];
    const SPLIT: &[Phase] = &[Phase::Forward, Phase::BackwardInput, Phase::BackwardWeight];
    let used: BTreeSet<Phase> = plan.schedule.iter().flatten().map(|step| step.phase).collect();
    if used.iter().all(|phase| WHOLE.contains(phase)) {
        Ok(WHOLE)
    } else if used.iter().all(|phase| SPLIT.contains(phase)) {
        Ok(SPLIT)
    } else {
        Err(malformed(format!("the schedule mixes whole and split backwards ({used:?}); use one or the other")))
    }
}

/// Checks that every rank runs every (micro-batch, chunk) once in each phase.
pub(super) fn check_plan(plan: &PipelinePlan, order_len: usize, phases: &[Phase]) -> Result<()> {
    let ranks = plan.schedule.len() as u32;
    if plan.stage_of.len() != order_len || ranks == 0 || plan.chunks == 0 {
        return Err(malformed(format!(
            "{} stage assignments, {ranks} rank schedules and {} chunks a rank for {order_len} nodes",
            plan.stage_of.len(),
            plan.chunks
        )));
    }
    if let Some(&stage) = plan.stage_of.iter().find(|&&stage| stage >= ranks * plan.chunks) {
        return Err(malformed(format!(
            "a node is placed in virtual stage {stage}, and {ranks} ranks of {} chunks have {}",
            plan.chunks,
            ranks * plan.chunks
        )));
    }
    for (rank, steps) in plan.schedule.iter().enumerate() {
        for chunk in 0..plan.chunks {
            for &phase in phases {
                let mut seen: Vec<u32> = steps
                    .iter()
                    .filter(|step| step.phase == phase && step.chunk == chunk)
                    .map(|step| step.micro_batch)
                    .collect();
                seen.sort_unstable();
                if seen != (0..plan.micro_batches).collect::<Vec<_>>() {
                    return Err(malformed(format!(
                        "rank {rank}'s schedule runs the {phase:?} of chunk {chunk} on micro-batches {seen:?}, not on \
                         each of 0..{} once",
                        plan.micro_batches
                    )));
                }
            }
        }
    }
    if plan.chunks == 1 {
        // Neighbouring stages that order their micro-batches differently would make every message
        // wait behind the others; refuse such a plan by name instead.
        for (stage, pair) in plan.schedule.windows(2).enumerate() {
            for &phase in phases {
                let order_of = |steps: &[ScheduleStep]| -> Vec<u32> {
                    steps.iter().filter(|step| step.phase == phase).map(|step| step.micro_batch).collect()
                };
                let (earlier, later) = (order_of(&pair[0]), order_of(&pair[1]));
                if earlier != later {
                    return Err(malformed(format!(
                        "stages {stage} and {} run the {phase:?} of the micro-batches in different orders ({earlier:?} \
                         and {later:?}); their messages would pair up wrongly",
                        stage + 1
                    )));
                }
            }
        }
    }
    Ok(())
}
