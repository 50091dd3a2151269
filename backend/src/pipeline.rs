//! Pipeline-parallel programs: one rank's program of a micro-batch, cut into stages and replayed
//! in a schedule's order.
//!
//! The input is a differentiated training module for one micro-batch, sharded over the mesh
//! inside a stage (tp, dp, ...), and the stage of every node. For each inner rank `i` the module is
//! lowered once (`lower_rank_traced`); stage `s` of the pipeline then runs, on global rank
//! `s · inner + i`, the instructions of its own nodes: its parameters are loaded once, and each
//! schedule step replays its forward or its backward instructions on that micro-batch's own copy of
//! every buffer. A value one stage defines and another reads travels as a `Send` right after its
//! definition and a `Recv` at the start of the reader's step (activations forward, their gradients
//! backward); a weight one stage owns and another reads (a tied LM head) travels the same way.
//! Graph outputs (the loss and the gradients) are summed over the micro-batches. Everything a step
//! wrote and no later step of that micro-batch reads is freed at the end of its backward, so the
//! measured memory follows the schedule: O(stages) micro-batches in flight for 1F1B, O(micro-
//! batches) for GPipe. Deadlock freedom is `verify_collectives`'s to prove on the result.

use std::collections::{BTreeSet, HashMap};

use pleat_ir::entity::EntityRef;
use pleat_ir::Module;

use crate::error::{Error, Result};
use crate::lower::lower_rank_traced;
use crate::program::{Buffer, BufferId, BufferKind, Group, Instr, Kernel, Program};

/// Whether a schedule step runs a micro-batch's forward or its backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Phase {
    /// The stage's forward nodes.
    Forward,
    /// The stage's backward nodes.
    Backward,
}

/// One step of one stage's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduleStep {
    /// The micro-batch.
    pub micro_batch: u32,
    /// Forward or backward.
    pub phase: Phase,
}

/// How the module is pipelined.
pub struct PipelinePlan<'a> {
    /// For each node, in the module's program order, its stage.
    pub stage_of: &'a [u32],
    /// Each stage's steps, in order; every micro-batch once forward, then once backward.
    pub schedule: &'a [Vec<ScheduleStep>],
    /// Micro-batches a step (each is the module's batch).
    pub micro_batches: u32,
}

fn malformed(reason: String) -> Error {
    Error::Pipeline { reason }
}

/// The layer a node belongs to, from pleat's names (`layer3.…`, `model.layers.3.…`, `grad.…`).
fn layer_of(name: &str) -> Option<u64> {
    let name = name.strip_prefix("grad.").unwrap_or(name);
    let rest = name.strip_prefix("layer").or_else(|| name.strip_prefix("model.layers."))?;
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// The stage of every node of `module`, in program order: layers split into `stages` contiguous
/// runs (`layers_per_stage`, or as even as they go, earlier stages taking the remainder).
pub fn stage_of_nodes(module: &Module, stages: u32, layers_per_stage: Option<&[u64]>, layers: u64) -> Result<Vec<u32>> {
    let stages = stages.max(1);
    if layers_per_stage.is_none() && layers < u64::from(stages) {
        return Err(malformed(format!(
            "pp={stages} needs at least one layer a stage, and the model has {layers} layers; use pp <= {layers}"
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
    graph
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
            let final_stage = ["final_norm", "model.norm", "lm_head", "loss", "logits"];
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
        .collect()
}

/// The programs of every pipeline rank, in global rank order (`stage · inner + inner_rank`).
pub fn pipeline_programs(module: &Module, plan: &PipelinePlan) -> Result<Vec<Program>> {
    let graph = &module.graph;
    let order = graph.order();
    let stages = plan.schedule.len() as u32;
    if plan.stage_of.len() != order.len() || stages == 0 {
        return Err(malformed(format!(
            "{} stage assignments and {stages} stage schedules for {} nodes",
            plan.stage_of.len(),
            order.len()
        )));
    }
    for (stage, steps) in plan.schedule.iter().enumerate() {
        for phase in [Phase::Forward, Phase::Backward] {
            let mut seen: Vec<u32> =
                steps.iter().filter(|step| step.phase == phase).map(|step| step.micro_batch).collect();
            seen.sort_unstable();
            if seen != (0..plan.micro_batches).collect::<Vec<_>>() {
                return Err(malformed(format!(
                    "stage {stage}'s schedule runs the {phase:?} of micro-batches {seen:?}, not each of 0..{} once",
                    plan.micro_batches
                )));
            }
        }
    }
    // Messages between two stages match in order (a queue per pair of ranks), so neighbouring
    // stages must run the micro-batches' forwards, and their backwards, in the same order.
    for (stage, pair) in plan.schedule.windows(2).enumerate() {
        for phase in [Phase::Forward, Phase::Backward] {
            let order_of = |steps: &[ScheduleStep]| -> Vec<u32> {
                steps.iter().filter(|step| step.phase == phase).map(|step| step.micro_batch).collect()
            };
            let (earlier, later) = (order_of(&pair[0]), order_of(&pair[1]));
            if earlier != later {
                return Err(malformed(format!(
                    "stages {stage} and {} run the {phase:?} of the micro-batches in different orders ({earlier:?} and \
                     {later:?}); their messages would pair up wrongly",
                    stage + 1
                )));
            }
        }
    }
    let loss = order
        .iter()
        .position(|&node| graph.node(node).op.is_loss())
        .ok_or_else(|| malformed("a pipelined module must be a training graph with a cross_entropy loss".into()))?;
    let inner = module.mesh.world_size() as u32;
    let mut programs: Vec<Option<Program>> = (0..stages * inner).map(|_| None).collect();
    for inner_rank in 0..inner {
        let (base, trace) = lower_rank_traced(module, inner_rank)?;
        let split = Split::new(&base, &trace, plan.stage_of, loss);
        for stage in 0..stages {
            let program = StageProgram::new(&base, &split, plan, stage, inner_rank, inner).build()?;
            programs[(stage * inner + inner_rank) as usize] = Some(program);
        }
    }
    Ok(programs.into_iter().map(|program| program.expect("every rank was built")).collect())
}

/// Which stage and phase each instruction of a base program belongs to, and which buffers cross
/// stages.
struct Split {
    /// Per instruction: its stage and phase (`None`: the trailing outputs).
    owner: Vec<Option<(u32, Phase)>>,
    /// Per buffer: the stage and phase of the instruction that writes it.
    writer: HashMap<BufferId, (u32, Phase)>,
}

impl Split {
    fn new(base: &Program, trace: &[Option<usize>], stage_of: &[u32], loss: usize) -> Split {
        let owner: Vec<Option<(u32, Phase)>> = trace
            .iter()
            .map(|node| node.map(|node| (stage_of[node], if node <= loss { Phase::Forward } else { Phase::Backward })))
            .collect();
        let mut writer = HashMap::new();
        for (instr, owner) in base.instructions.iter().zip(&owner) {
            if let Some(owner) = owner {
                for out in instr.outs() {
                    writer.entry(out).or_insert(*owner);
                }
            }
        }
        Split { owner, writer }
    }
}

/// Builds one stage's program for one inner rank.
struct StageProgram<'a> {
    base: &'a Program,
    split: &'a Split,
    plan: &'a PipelinePlan<'a>,
    stage: u32,
    inner_rank: u32,
    inner: u32,
    program: Program,
    /// Per micro-batch, the buffers written and not yet freed.
    live: Vec<BTreeSet<BufferId>>,
    /// Per graph output buffer (base id): the running sum over micro-batches, if any yet.
    sums: HashMap<BufferId, BufferId>,
}

impl<'a> StageProgram<'a> {
    fn new(
        base: &'a Program,
        split: &'a Split,
        plan: &'a PipelinePlan,
        stage: u32,
        inner_rank: u32,
        inner: u32,
    ) -> Self {
        let micro_batches = plan.micro_batches as usize;
        let mut buffers = Vec::with_capacity(base.buffers.len() * micro_batches);
        for micro_batch in 0..micro_batches {
            for buffer in &base.buffers {
                let name =
                    if micro_batch == 0 { buffer.name.clone() } else { format!("{}@{micro_batch}", buffer.name) };
                buffers.push(Buffer { name, ..buffer.clone() });
            }
        }
        let mut tokens_shape = base.tokens_shape.clone();
        if let Some(batch) = tokens_shape.first_mut() {
            *batch *= u64::from(plan.micro_batches);
        }
        let program = Program {
            format_version: base.format_version,
            model: base.model.clone(),
            mesh: if base.mesh.is_empty() {
                format!("pp={}", plan.schedule.len())
            } else {
                format!("pp={},{}", plan.schedule.len(), base.mesh)
            },
            rank: stage * inner + inner_rank,
            world_size: plan.schedule.len() as u32 * inner,
            tokens_shape,
            buffers,
            instructions: Vec::new(),
        };
        StageProgram {
            base,
            split,
            plan,
            stage,
            inner_rank,
            inner,
            program,
            live: vec![BTreeSet::new(); micro_batches],
            sums: HashMap::new(),
        }
    }

    fn global(&self, stage: u32, inner_rank: u32) -> u32 {
        stage * self.inner + inner_rank
    }

    /// Buffer `buffer` of the base program in micro-batch `micro_batch`'s copy (parameters have one).
    fn copy(&self, buffer: BufferId, micro_batch: u32) -> BufferId {
        if self.base.buffer(buffer).kind == BufferKind::Param {
            buffer
        } else {
            BufferId::new(buffer.as_u32() as usize + micro_batch as usize * self.base.buffers.len())
        }
    }

    fn build(mut self) -> Result<Program> {
        // Parameters load once, before the first step.
        for (instr, owner) in self.base.instructions.iter().zip(&self.split.owner) {
            if matches!(instr, Instr::LoadParam { .. }) && owner.map(|(stage, _)| stage) == Some(self.stage) {
                self.program.instructions.push(instr.clone());
            }
        }
        for step in &self.plan.schedule[self.stage as usize] {
            self.step(*step)?;
        }
        for instr in &self.base.instructions {
            let Instr::Output { buf, index, shape, region } = instr else { continue };
            if let Some(&sum) = self.sums.get(buf) {
                let (index, shape, region) = (*index, shape.clone(), region.clone());
                self.program.instructions.push(Instr::Output { buf: sum, index, shape, region });
            }
        }
        Ok(self.program)
    }

    /// Whether the base instruction at `at` runs in this stage's `phase`: its own, or an input
    /// load the phase's instructions read (every stage loads the tokens and positions it uses).
    fn runs(&self, at: usize, phase: Phase) -> bool {
        let instr = &self.base.instructions[at];
        if matches!(instr, Instr::LoadParam { .. } | Instr::Output { .. }) {
            return false;
        }
        if matches!(instr, Instr::LoadTokens { .. } | Instr::LoadPositions { .. }) {
            let out = instr.out().expect("a load writes one buffer");
            return phase == Phase::Forward && self.reads_in_stage(out);
        }
        self.split.owner[at] == Some((self.stage, phase))
    }

    fn reads_in_stage(&self, buffer: BufferId) -> bool {
        self.base
            .instructions
            .iter()
            .zip(&self.split.owner)
            .any(|(instr, owner)| owner.map(|(stage, _)| stage) == Some(self.stage) && instr.inputs().contains(&buffer))
    }

    fn step(&mut self, step: ScheduleStep) -> Result<()> {
        let ScheduleStep { micro_batch, phase } = step;
        let mine: Vec<usize> = (0..self.base.instructions.len()).filter(|&at| self.runs(at, phase)).collect();
        // Values other stages define in this phase that this stage reads arrive first, one message
        // each. A forward value arrives in the forward step even when only the backward reads it.
        let mut incoming: BTreeSet<(u32, BufferId)> = BTreeSet::new();
        for (instr, owner) in self.base.instructions.iter().zip(&self.split.owner) {
            let Some((stage, reader_phase)) = *owner else { continue };
            if stage != self.stage || (phase == Phase::Backward && reader_phase == Phase::Forward) {
                continue;
            }
            for input in instr.inputs() {
                let Some(&(writer_stage, writer_phase)) = self.split.writer.get(&input) else { continue };
                if writer_stage != self.stage && writer_phase == phase && !self.is_load(input) {
                    incoming.insert((writer_stage, input));
                }
            }
        }
        for (stage, buffer) in incoming {
            let out = self.copy(buffer, micro_batch);
            if self.live[micro_batch as usize].insert(out) {
                let peer = self.global(stage, self.inner_rank);
                self.program.instructions.push(Instr::Recv { outs: vec![out], peer });
            }
        }
        for at in mine {
            let instr = self.base.instructions[at].clone();
            if let Instr::Free { buf } = instr {
                let copy = self.copy(buf, micro_batch);
                if self.is_output(buf) || !self.live[micro_batch as usize].remove(&copy) {
                    continue;
                }
                self.program.instructions.push(Instr::Free { buf: copy });
                continue;
            }
            let remapped = self.remap(&instr, micro_batch);
            self.program.instructions.push(remapped);
            for out in instr.outs() {
                let copy = self.copy(out, micro_batch);
                self.live[micro_batch as usize].insert(copy);
                self.send_to_readers(out, micro_batch, phase);
                if self.is_output(out) {
                    self.accumulate(out, micro_batch);
                }
            }
        }
        if phase == Phase::Backward {
            // The micro-batch is done on this stage: release what it still holds.
            let held = std::mem::take(&mut self.live[micro_batch as usize]);
            for buffer in held {
                if self.base.buffer(self.base_of(buffer)).kind != BufferKind::Param {
                    self.program.instructions.push(Instr::Free { buf: buffer });
                }
            }
        }
        Ok(())
    }

    /// Whether `buffer` is a token or position load (every stage loads its own).
    fn is_load(&self, buffer: BufferId) -> bool {
        self.base.instructions.iter().any(
            |instr| matches!(instr, Instr::LoadTokens { out, .. } | Instr::LoadPositions { out, .. } if *out == buffer),
        )
    }

    fn base_of(&self, copy: BufferId) -> BufferId {
        BufferId::new(copy.as_u32() as usize % self.base.buffers.len())
    }

    fn is_output(&self, buffer: BufferId) -> bool {
        self.base.instructions.iter().any(|instr| matches!(instr, Instr::Output { buf, .. } if *buf == buffer))
    }

    /// Sends `buffer` (just written) to every other stage that reads it, once each.
    fn send_to_readers(&mut self, buffer: BufferId, micro_batch: u32, phase: Phase) {
        if self.is_load(buffer) {
            return;
        }
        let mut readers: BTreeSet<u32> = BTreeSet::new();
        for (instr, owner) in self.base.instructions.iter().zip(&self.split.owner) {
            let Some((stage, reader_phase)) = *owner else { continue };
            if stage != self.stage
                && instr.inputs().contains(&buffer)
                && (reader_phase == phase || phase == Phase::Forward)
            {
                readers.insert(stage);
            }
        }
        let copy = self.copy(buffer, micro_batch);
        for stage in readers {
            let peer = self.global(stage, self.inner_rank);
            self.program.instructions.push(Instr::Send { bufs: vec![copy], peer });
        }
    }

    /// Adds micro-batch `micro_batch`'s value of output `buffer` into its running sum.
    fn accumulate(&mut self, buffer: BufferId, micro_batch: u32) {
        let value = self.copy(buffer, micro_batch);
        let like = self.base.buffer(buffer).clone();
        let sum = BufferId::new(self.program.buffers.len());
        self.program.buffers.push(Buffer { name: format!("{}.sum{micro_batch}", like.name), ..like });
        let shape = self.program.buffer(value).shape.clone();
        let kernel = match self.sums.get(&buffer) {
            None => Instr::Kernel {
                kernel: Kernel::Slice { region: shape.iter().map(|&len| (0, len)).collect(), shape },
                inputs: vec![value],
                out: sum,
            },
            Some(&previous) => Instr::Kernel { kernel: Kernel::Add, inputs: vec![previous, value], out: sum },
        };
        self.program.instructions.push(kernel);
        if let Some(previous) = self.sums.insert(buffer, sum) {
            self.program.instructions.push(Instr::Free { buf: previous });
        }
    }

    /// `instr` on micro-batch `micro_batch`'s buffers, with inner ranks made global and token loads
    /// reading that micro-batch's rows.
    fn remap(&self, instr: &Instr, micro_batch: u32) -> Instr {
        let buffer = |id: &BufferId| self.copy(*id, micro_batch);
        let buffers = |ids: &[BufferId]| ids.iter().map(buffer).collect::<Vec<_>>();
        let group = |group: &Group| Group {
            axis: group.axis.clone(),
            ranks: group.ranks.iter().map(|&rank| self.global(self.stage, rank)).collect(),
        };
        let peer = |peer: &u32| self.global(self.stage, *peer);
        match instr {
            Instr::LoadParam { .. } | Instr::Output { .. } | Instr::Free { .. } => instr.clone(),
            Instr::LoadTokens { out, region } => {
                let mut region = region.clone();
                let rows = self.base.tokens_shape.first().copied().unwrap_or(1);
                if let Some(first) = region.first_mut() {
                    first.0 += u64::from(micro_batch) * rows;
                }
                Instr::LoadTokens { out: buffer(out), region }
            }
            Instr::LoadPositions { out, region } => Instr::LoadPositions { out: buffer(out), region: region.clone() },
            Instr::Kernel { kernel, inputs, out } => {
                // The loss of each micro-batch is divided by every micro-batch's targets, so the
                // micro-batches' losses and gradients sum to the step's.
                let mut kernel = kernel.clone();
                kernel.scale_loss_terms(u64::from(self.plan.micro_batches));
                Instr::Kernel { kernel, inputs: buffers(inputs), out: buffer(out) }
            }
            Instr::AllReduce { input, out, group: g } => {
                Instr::AllReduce { input: buffer(input), out: buffer(out), group: group(g) }
            }
            Instr::ReduceScatter { input, out, group: g, dim } => {
                Instr::ReduceScatter { input: buffer(input), out: buffer(out), group: group(g), dim: *dim }
            }
            Instr::AllGather { input, out, group: g, dim } => {
                Instr::AllGather { input: buffer(input), out: buffer(out), group: group(g), dim: *dim }
            }
            Instr::AllToAll { input, out, group: g, split_dim, gather_dim } => Instr::AllToAll {
                input: buffer(input),
                out: buffer(out),
                group: group(g),
                split_dim: *split_dim,
                gather_dim: *gather_dim,
            },
            Instr::Broadcast { inputs, outs, group: g, root } => {
                Instr::Broadcast { inputs: buffers(inputs), outs: buffers(outs), group: group(g), root: *root }
            }
            Instr::Send { bufs, peer: p } => Instr::Send { bufs: buffers(bufs), peer: peer(p) },
            Instr::Recv { outs, peer: p } => Instr::Recv { outs: buffers(outs), peer: peer(p) },
        }
    }
}
