//! Pipeline-parallel programs: one rank's program of a micro-batch, cut into stages and replayed
//! in a schedule's order.
//!
//! The input is a differentiated training module for one micro-batch, sharded over the mesh
//! inside a stage (tp, dp, ...), and the virtual stage of every node. With `v` model chunks a
//! rank (interleaved schedules) there are `p · v` virtual stages and pipeline rank `r` holds
//! virtual stages `r, r + p, r + 2p, ...` (its chunks 0, 1, 2, ...); without, a virtual stage is a
//! rank. For each inner rank `i` the module is lowered once (`lower_rank_traced`); pipeline rank
//! `r` then runs, on global rank `r · inner + i`, the instructions of its own nodes: its
//! parameters are loaded once, and each schedule step replays one chunk's forward or backward
//! (or, for zero-bubble schedules, the backward's input-gradient part `B` or weight-gradient part
//! `W`, see the `phases` module) on that micro-batch's own copy of every buffer.
//!
//! A value one rank defines and another reads travels as a `Send` right after its definition and
//! a `Recv` in the reader's step (activations forward, their gradients backward). A weight one
//! stage owns and another reads (a tied LM head reading the embedding table) is sent once a step,
//! in the owner's first forward, and the reader's contribution to its gradient travels back like an
//! activation's gradient, to be summed on the owner. Messages between two ranks pair up in order
//! (a queue a pair), so a rank receives in its sender's order: when a step needs a message, the
//! messages queued before it are received first and kept for their own steps. Graph outputs (the
//! loss and the gradients) are summed over the micro-batches. Everything a micro-batch wrote and
//! no later step of it reads is freed at the end of its last backward step on the rank, so the
//! measured memory follows the schedule: O(stages) micro-batches in flight for 1F1B, O(micro-
//! batches) for GPipe. Deadlock freedom is `verify_collectives`'s to prove on the result.
//!
//! Submodules: `phases` splits the backward into `B` and `W`; `plan` places the nodes in stages
//! ([`stage_of_nodes`]) and checks a schedule before it is replayed.

mod phases;
mod plan;

use std::collections::{BTreeSet, HashMap, HashSet};
use std::ops::Range;

use pleat_ir::entity::EntityRef;
use pleat_ir::Module;

use crate::error::{Error, Result};
use crate::lower::lower_rank_traced;
use crate::program::{Buffer, BufferId, BufferKind, Group, Instr, Kernel, Program};
use plan::{check_plan, phases_of};
pub use plan::{gather_params_on_each_stage, stage_of_nodes};

/// What a schedule step runs of one micro-batch on one model chunk.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Phase {
    /// The chunk's forward nodes.
    Forward,
    /// The chunk's whole backward.
    Backward,
    /// The backward's input-gradient part (zero-bubble `B`): what the previous stage waits for.
    BackwardInput,
    /// The backward's weight-gradient part (zero-bubble `W`): what no other stage waits for.
    BackwardWeight,
}

impl Phase {
    /// Steps of a micro-batch run in this order on a chunk: forward, then backward (input
    /// gradient, then weight gradient).
    fn rank(self) -> u8 {
        match self {
            Phase::Forward => 0,
            Phase::Backward | Phase::BackwardInput => 1,
            Phase::BackwardWeight => 2,
        }
    }
}

/// One step of one pipeline rank's schedule.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScheduleStep {
    /// The micro-batch.
    pub micro_batch: u32,
    /// The rank's model chunk (0 without interleaving): virtual stage `chunk · ranks + rank`.
    pub chunk: u32,
    /// What the step runs.
    pub phase: Phase,
}

impl From<pleat_passes::pipeline::Step> for ScheduleStep {
    /// The executed step of a planned one (`pleat_passes::pipeline::Schedule`).
    fn from(step: pleat_passes::pipeline::Step) -> ScheduleStep {
        use pleat_passes::pipeline::Phase as Planned;
        let phase = match step.phase {
            Planned::Forward => Phase::Forward,
            Planned::Backward => Phase::Backward,
            Planned::BackwardInput => Phase::BackwardInput,
            Planned::BackwardWeight => Phase::BackwardWeight,
        };
        ScheduleStep { micro_batch: step.micro_batch, chunk: step.chunk, phase }
    }
}

impl From<ScheduleStep> for pleat_passes::pipeline::Step {
    /// The planned step of an executed one (pictures draw the planner's steps).
    fn from(step: ScheduleStep) -> pleat_passes::pipeline::Step {
        use pleat_passes::pipeline::Phase as Planned;
        let phase = match step.phase {
            Phase::Forward => Planned::Forward,
            Phase::Backward => Planned::Backward,
            Phase::BackwardInput => Planned::BackwardInput,
            Phase::BackwardWeight => Planned::BackwardWeight,
        };
        pleat_passes::pipeline::Step { micro_batch: step.micro_batch, chunk: step.chunk, phase }
    }
}

/// Each pipeline rank's steps of the planner's `schedule` (`pleat schedule` draws the same ones).
pub fn schedule_steps(schedule: &pleat_passes::pipeline::Schedule) -> Vec<Vec<ScheduleStep>> {
    schedule.per_stage.iter().map(|steps| steps.iter().map(|&step| ScheduleStep::from(step)).collect()).collect()
}

/// How the module is pipelined.
pub struct PipelinePlan<'a> {
    /// For each node, in the module's program order, its virtual stage (`chunk · ranks + rank`).
    pub stage_of: &'a [u32],
    /// Each pipeline rank's steps, in order. Every (micro-batch, chunk) appears once a phase:
    /// `Forward` and `Backward`, or `Forward`, `BackwardInput` and `BackwardWeight`.
    pub schedule: &'a [Vec<ScheduleStep>],
    /// Micro-batches a step (each is the module's batch).
    pub micro_batches: u32,
    /// Model chunks a rank (1 without interleaving).
    pub chunks: u32,
}

fn malformed(reason: String) -> Error {
    Error::Pipeline { reason }
}

/// The phase of every node of `module` under `plan`'s schedule, in program order.
pub fn node_phases(module: &Module, plan: &PipelinePlan) -> Result<Vec<Phase>> {
    let phases = phases_of(plan)?;
    let graph = &module.graph;
    let loss = graph
        .order()
        .iter()
        .position(|&node| graph.node(node).op.is_loss())
        .ok_or_else(|| malformed("a pipelined module must be a training graph with a cross_entropy loss".into()))?;
    Ok(phases::node_phases(module, loss, phases.len() == 3))
}

/// Where one schedule step's instructions lie in a rank's program.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StepSpan {
    /// The step.
    pub step: ScheduleStep,
    /// Its instructions (receives first, then its compute and sends), as indices in the program.
    pub instructions: Range<usize>,
}

/// The programs of every pipeline rank, in global rank order (`rank · inner + inner_rank`).
pub fn pipeline_programs(module: &Module, plan: &PipelinePlan) -> Result<Vec<Program>> {
    Ok(pipeline_programs_with_spans(module, plan)?.into_iter().map(|(program, _)| program).collect())
}

/// As [`pipeline_programs`], each program with its steps' spans in schedule order (what turns a
/// measured run's instruction timings into a timeline of F/B/W blocks).
pub fn pipeline_programs_with_spans(module: &Module, plan: &PipelinePlan) -> Result<Vec<(Program, Vec<StepSpan>)>> {
    let order_len = module.graph.order().len();
    let phases = phases_of(plan)?;
    check_plan(plan, order_len, phases)?;
    let node_phase = node_phases(module, plan)?;
    let ranks = plan.schedule.len() as u32;
    let inner = module.mesh.world_size() as u32;
    let mut programs: Vec<Option<(Program, Vec<StepSpan>)>> = (0..ranks * inner).map(|_| None).collect();
    for inner_rank in 0..inner {
        let (base, trace) = lower_rank_traced(module, inner_rank)?;
        let split = Split::new(&base, &trace, plan.stage_of, &node_phase, ranks);
        // Sends do not depend on where receives go: a first build gives every queue's order, the
        // second receives in it.
        let mut queues: HashMap<(u32, u32), Vec<BufferId>> = HashMap::new();
        for rank in 0..ranks {
            let (program, _) = StageProgram::new(&base, &split, plan, rank, inner_rank, inner, None).build()?;
            for instr in &program.instructions {
                if let Instr::Send { bufs, peer } = instr {
                    queues.entry((program.rank, *peer)).or_default().extend(bufs);
                }
            }
        }
        for rank in 0..ranks {
            let program = StageProgram::new(&base, &split, plan, rank, inner_rank, inner, Some(&queues)).build()?;
            programs[(rank * inner + inner_rank) as usize] = Some(program);
        }
    }
    Ok(programs.into_iter().map(|program| program.expect("every rank was built")).collect())
}

/// Which virtual stage and phase each instruction of a base program belongs to, and who reads
/// and writes each buffer.
struct Split {
    /// Pipeline ranks.
    ranks: u32,
    /// Per instruction: its virtual stage and phase (`None`: the trailing outputs).
    owner: Vec<Option<(u32, Phase)>>,
    /// Per buffer: the virtual stage and phase of the instruction that writes it.
    writer: HashMap<BufferId, (u32, Phase)>,
    /// Per buffer: the virtual stages and phases of the instructions that read it.
    readers: HashMap<BufferId, BTreeSet<(u32, Phase)>>,
    /// Token and position buffers (every rank loads its own).
    loads: HashSet<BufferId>,
    /// Graph output buffers.
    outputs: HashSet<BufferId>,
}

impl Split {
    fn new(base: &Program, trace: &[Option<usize>], stage_of: &[u32], phase_of: &[Phase], ranks: u32) -> Split {
        let owner: Vec<Option<(u32, Phase)>> =
            trace.iter().map(|node| node.map(|node| (stage_of[node], phase_of[node]))).collect();
        let mut writer = HashMap::new();
        let mut readers: HashMap<BufferId, BTreeSet<(u32, Phase)>> = HashMap::new();
        let mut loads = HashSet::new();
        let mut outputs = HashSet::new();
        for (instr, owner) in base.instructions.iter().zip(&owner) {
            match instr {
                Instr::LoadTokens { out, .. } | Instr::LoadPositions { out, .. } => {
                    loads.insert(*out);
                }
                Instr::Output { buf, .. } => {
                    outputs.insert(*buf);
                }
                _ => {}
            }
            if let Some(owner) = owner {
                for out in instr.outs() {
                    writer.entry(out).or_insert(*owner);
                }
                if !matches!(instr, Instr::Free { .. }) {
                    for input in instr.inputs() {
                        readers.entry(input).or_default().insert(*owner);
                    }
                }
            }
        }
        Split { ranks, owner, writer, readers, loads, outputs }
    }

    fn rank_of(&self, virtual_stage: u32) -> u32 {
        virtual_stage % self.ranks
    }
}

/// Builds one pipeline rank's program for one inner rank.
struct StageProgram<'a> {
    base: &'a Program,
    split: &'a Split,
    plan: &'a PipelinePlan<'a>,
    rank: u32,
    inner_rank: u32,
    inner: u32,
    program: Program,
    /// Per micro-batch, the buffers written or received and not yet freed.
    live: Vec<BTreeSet<BufferId>>,
    /// Per micro-batch, its last-phase backward steps still to run on this rank.
    backwards_left: Vec<u32>,
    /// Parameters received from their owner (once a step).
    received_params: BTreeSet<BufferId>,
    /// Parameters sent to the ranks that read them (once a step).
    sent_params: BTreeSet<BufferId>,
    /// Per graph output buffer (base id): the running sum over micro-batches, if any yet.
    sums: HashMap<BufferId, BufferId>,
    /// Each sender's messages to this rank in its order (global ranks), once known.
    queues: Option<&'a HashMap<(u32, u32), Vec<BufferId>>>,
    /// Per sender (global rank): how many of its messages this rank has received.
    received: HashMap<u32, usize>,
}

impl<'a> StageProgram<'a> {
    fn new(
        base: &'a Program,
        split: &'a Split,
        plan: &'a PipelinePlan,
        rank: u32,
        inner_rank: u32,
        inner: u32,
        queues: Option<&'a HashMap<(u32, u32), Vec<BufferId>>>,
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
        let ranks = plan.schedule.len() as u32;
        let program = Program {
            format_version: base.format_version,
            model: base.model.clone(),
            mesh: if base.mesh.is_empty() { format!("pp={ranks}") } else { format!("pp={ranks},{}", base.mesh) },
            rank: rank * inner + inner_rank,
            world_size: ranks * inner,
            tokens_shape,
            buffers,
            instructions: Vec::new(),
        };
        let last = if plan.schedule.iter().flatten().any(|step| step.phase == Phase::BackwardWeight) {
            Phase::BackwardWeight
        } else {
            Phase::Backward
        };
        let mut backwards_left = vec![0; micro_batches];
        for step in plan.schedule[rank as usize].iter().filter(|step| step.phase == last) {
            backwards_left[step.micro_batch as usize] += 1;
        }
        StageProgram {
            base,
            split,
            plan,
            rank,
            inner_rank,
            inner,
            program,
            live: vec![BTreeSet::new(); micro_batches],
            backwards_left,
            received_params: BTreeSet::new(),
            sent_params: BTreeSet::new(),
            sums: HashMap::new(),
            queues,
            received: HashMap::new(),
        }
    }

    fn global(&self, rank: u32, inner_rank: u32) -> u32 {
        rank * self.inner + inner_rank
    }

    /// Whether virtual stage `virtual_stage` is one of this rank's chunks.
    fn holds(&self, virtual_stage: u32) -> bool {
        self.split.rank_of(virtual_stage) == self.rank
    }

    /// Whether `buffer` (a base buffer or a micro-batch's copy of one) is a parameter.
    fn is_param(&self, buffer: BufferId) -> bool {
        self.base.buffer(self.base_of(buffer)).kind == BufferKind::Param
    }

    /// Buffer `buffer` of the base program in micro-batch `micro_batch`'s copy (parameters have one).
    fn copy(&self, buffer: BufferId, micro_batch: u32) -> BufferId {
        if self.is_param(buffer) {
            buffer
        } else {
            BufferId::new(buffer.as_u32() as usize + micro_batch as usize * self.base.buffers.len())
        }
    }

    fn base_of(&self, copy: BufferId) -> BufferId {
        BufferId::new(copy.as_u32() as usize % self.base.buffers.len())
    }

    fn micro_batch_of(&self, copy: BufferId) -> usize {
        copy.as_u32() as usize / self.base.buffers.len()
    }

    fn build(mut self) -> Result<(Program, Vec<StepSpan>)> {
        // Parameters load once, before the first step.
        for (instr, owner) in self.base.instructions.iter().zip(&self.split.owner) {
            if matches!(instr, Instr::LoadParam { .. }) && owner.is_some_and(|(stage, _)| self.holds(stage)) {
                self.program.instructions.push(instr.clone());
            }
        }
        let mut spans = Vec::with_capacity(self.plan.schedule[self.rank as usize].len());
        for step in &self.plan.schedule[self.rank as usize] {
            let start = self.program.instructions.len();
            self.step(*step)?;
            spans.push(StepSpan { step: *step, instructions: start..self.program.instructions.len() });
        }
        for instr in &self.base.instructions {
            let Instr::Output { buf, index, shape, region } = instr else { continue };
            if let Some(&sum) = self.sums.get(buf) {
                let (index, shape, region) = (*index, shape.clone(), region.clone());
                self.program.instructions.push(Instr::Output { buf: sum, index, shape, region });
            }
        }
        Ok((self.program, spans))
    }

    /// Whether the base instruction at `at` runs in `virtual_stage`'s `phase`: its own, or an
    /// input load the stage reads (every rank loads the tokens and positions it uses).
    fn runs(&self, at: usize, virtual_stage: u32, phase: Phase) -> bool {
        let instr = &self.base.instructions[at];
        if matches!(instr, Instr::LoadParam { .. } | Instr::Output { .. }) {
            return false;
        }
        if matches!(instr, Instr::LoadTokens { .. } | Instr::LoadPositions { .. }) {
            let out = instr.out().expect("a load writes one buffer");
            let read = self.split.readers.get(&out);
            return phase == Phase::Forward && read.is_some_and(|read| read.iter().any(|&(s, _)| s == virtual_stage));
        }
        self.split.owner[at] == Some((virtual_stage, phase))
    }

    /// Receives `copy` from global rank `peer`, and before it whatever `peer` queued ahead of it.
    fn receive(&mut self, peer: u32, copy: BufferId) -> Result<()> {
        if self.is_param(copy) && !self.received_params.insert(copy) {
            return Ok(());
        }
        let Some(queues) = self.queues else {
            if !self.is_param(copy) {
                let micro_batch = self.micro_batch_of(copy);
                self.live[micro_batch].insert(copy);
            }
            self.program.instructions.push(Instr::Recv { outs: vec![copy], peer });
            return Ok(());
        };
        let queue = queues.get(&(peer, self.program.rank)).map_or(&[][..], Vec::as_slice);
        loop {
            let at = self.received.entry(peer).or_insert(0);
            let Some(&next) = queue.get(*at) else {
                return Err(malformed(format!(
                    "rank {} waits for buffer {copy} from rank {peer}, which never sends it",
                    self.program.rank
                )));
            };
            *at += 1;
            if self.is_param(next) {
                self.received_params.insert(next);
            } else {
                let micro_batch = self.micro_batch_of(next);
                self.live[micro_batch].insert(next);
            }
            self.program.instructions.push(Instr::Recv { outs: vec![next], peer });
            if next == copy {
                return Ok(());
            }
        }
    }

    /// Whether this rank still holds `copy`: received or computed for its micro-batch and not freed.
    fn has(&self, copy: BufferId) -> bool {
        if self.is_param(copy) {
            self.received_params.contains(&copy)
        } else {
            self.live[self.micro_batch_of(copy)].contains(&copy)
        }
    }

    fn step(&mut self, step: ScheduleStep) -> Result<()> {
        let ScheduleStep { micro_batch, chunk, phase } = step;
        let virtual_stage = chunk * self.split.ranks + self.rank;
        // Values other ranks write in this phase that this stage reads arrive first. A forward
        // value arrives in the forward step even when only the backward reads it, and a value
        // of the backward's first part even when only its second part reads it. A later stage's
        // forward value that this stage's backward reads (the load-balancing loss's statistics,
        // summed beside the loss) is written after this stage's forward, so it arrives in the
        // reading step.
        let mut incoming: BTreeSet<(u32, BufferId)> = BTreeSet::new();
        for (instr, owner) in self.base.instructions.iter().zip(&self.split.owner) {
            let Some((stage, reader_phase)) = *owner else { continue };
            if stage != virtual_stage || reader_phase.rank() < phase.rank() || matches!(instr, Instr::Free { .. }) {
                continue;
            }
            for input in instr.inputs() {
                let Some(&(writer_stage, writer_phase)) = self.split.writer.get(&input) else { continue };
                let arrival = if writer_phase == Phase::Forward && writer_stage > virtual_stage {
                    reader_phase
                } else {
                    writer_phase
                };
                if !self.holds(writer_stage) && arrival == phase && !self.split.loads.contains(&input) {
                    incoming.insert((self.split.rank_of(writer_stage), input));
                }
            }
        }
        for (rank, buffer) in incoming {
            let copy = self.copy(buffer, micro_batch);
            if !self.has(copy) {
                self.receive(self.global(rank, self.inner_rank), copy)?;
            }
        }
        if phase == Phase::Forward {
            // Weights this stage owns that other ranks read (a tied LM head) go out once a step.
            let params: Vec<BufferId> = self
                .base
                .instructions
                .iter()
                .zip(&self.split.owner)
                .filter_map(|(instr, owner)| match (instr, owner) {
                    (Instr::LoadParam { out, .. }, Some((stage, _))) if *stage == virtual_stage => Some(*out),
                    _ => None,
                })
                .collect();
            for param in params {
                if self.sent_params.insert(param) {
                    self.send_to_readers(param, micro_batch, virtual_stage, phase);
                }
            }
        }
        let mine: Vec<usize> =
            (0..self.base.instructions.len()).filter(|&at| self.runs(at, virtual_stage, phase)).collect();
        for at in mine {
            let instr = self.base.instructions[at].clone();
            if let Instr::Free { buf } = instr {
                let copy = self.copy(buf, micro_batch);
                if self.split.outputs.contains(&buf)
                    || self.read_later(buf, virtual_stage, phase)
                    || !self.live[micro_batch as usize].remove(&copy)
                {
                    continue;
                }
                self.program.instructions.push(Instr::Free { buf: copy });
                continue;
            }
            if matches!(instr, Instr::LoadTokens { .. } | Instr::LoadPositions { .. })
                && instr.out().is_some_and(|out| self.has(self.copy(out, micro_batch)))
            {
                // Another chunk of this rank loaded it for the micro-batch already.
                continue;
            }
            let remapped = self.remap(&instr, micro_batch);
            self.program.instructions.push(remapped);
            for out in instr.outs() {
                let copy = self.copy(out, micro_batch);
                self.live[micro_batch as usize].insert(copy);
                self.send_to_readers(out, micro_batch, virtual_stage, phase);
                if self.split.outputs.contains(&out) {
                    self.accumulate(out, micro_batch);
                }
            }
        }
        if matches!(phase, Phase::Backward | Phase::BackwardWeight) {
            let left = &mut self.backwards_left[micro_batch as usize];
            *left = left.saturating_sub(1);
            if *left == 0 {
                // The micro-batch is done on this rank: release what it still holds.
                let held = std::mem::take(&mut self.live[micro_batch as usize]);
                for buffer in held {
                    if !self.is_param(self.base_of(buffer)) {
                        self.program.instructions.push(Instr::Free { buf: buffer });
                    }
                }
            }
        }
        Ok(())
    }

    /// Whether a step of this rank other than (`virtual_stage`, `phase`), and not before it, reads
    /// `buffer`: then its free waits for the end of the micro-batch.
    fn read_later(&self, buffer: BufferId, virtual_stage: u32, phase: Phase) -> bool {
        self.split.readers.get(&buffer).is_some_and(|readers| {
            readers.iter().any(|&(stage, reader_phase)| {
                self.holds(stage)
                    && (stage, reader_phase) != (virtual_stage, phase)
                    && (stage != virtual_stage || reader_phase.rank() > phase.rank())
            })
        })
    }

    /// Sends `buffer` (just written by `virtual_stage` in `phase`) to every other rank that reads
    /// it, once each.
    fn send_to_readers(&mut self, buffer: BufferId, micro_batch: u32, virtual_stage: u32, phase: Phase) {
        if self.split.loads.contains(&buffer) {
            return;
        }
        let Some(readers) = self.split.readers.get(&buffer) else { return };
        let ranks: BTreeSet<u32> = readers
            .iter()
            .filter(|&&(stage, reader_phase)| {
                stage != virtual_stage && !self.holds(stage) && reader_phase.rank() >= phase.rank()
            })
            .map(|&(stage, _)| self.split.rank_of(stage))
            .collect();
        let copy = self.copy(buffer, micro_batch);
        for rank in ranks {
            let peer = self.global(rank, self.inner_rank);
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
            ranks: group.ranks.iter().map(|&rank| self.global(self.rank, rank)).collect(),
        };
        let peer = |peer: &u32| self.global(self.rank, *peer);
        match instr {
            Instr::LoadParam { .. } | Instr::Output { .. } | Instr::Free { .. } => instr.clone(),
            Instr::Wait { handle } => Instr::Wait { handle: buffers(handle) },
            Instr::ExpertDispatch { inputs, outs, wrts, group: g, dims } => Instr::ExpertDispatch {
                inputs: buffers(inputs),
                outs: buffers(outs),
                wrts: wrts.clone(),
                group: group(g),
                dims: dims.clone(),
            },
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
            Instr::AllReduce { inputs, outs, group: g } => {
                Instr::AllReduce { inputs: buffers(inputs), outs: buffers(outs), group: group(g) }
            }
            Instr::ReduceScatter { inputs, outs, group: g, dims } => Instr::ReduceScatter {
                inputs: buffers(inputs),
                outs: buffers(outs),
                group: group(g),
                dims: dims.clone(),
            },
            Instr::AllGather { input, out, group: g, dim, stream } => {
                Instr::AllGather { input: buffer(input), out: buffer(out), group: group(g), dim: *dim, stream: *stream }
            }
            Instr::AllToAll { input, out, group: g, split_dim, gather_dim } => Instr::AllToAll {
                input: buffer(input),
                out: buffer(out),
                group: group(g),
                split_dim: *split_dim,
                gather_dim: *gather_dim,
            },
            Instr::Broadcast { inputs, outs, group: g, root, stream } => Instr::Broadcast {
                inputs: buffers(inputs),
                outs: buffers(outs),
                group: group(g),
                root: *root,
                stream: *stream,
            },
            Instr::Send { bufs, peer: p } => Instr::Send { bufs: buffers(bufs), peer: peer(p) },
            Instr::Recv { outs, peer: p } => Instr::Recv { outs: buffers(outs), peer: peer(p) },
            Instr::Relay { outs, from, to } => Instr::Relay { outs: buffers(outs), from: peer(from), to: peer(to) },
        }
    }
}
