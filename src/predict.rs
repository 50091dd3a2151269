//! What each instruction of a `Program` is (stream, name, bytes, flops) and the predicted timeline
//! of every rank's program under the cost model.
//!
//! The prediction runs each rank's program as the runtime does, on its streams. The compute stream
//! runs the instructions in program order. A transfer starts on its communication stream (the main
//! one, or the prefetch stream for a weight prefetch) when the compute stream reaches it and the
//! transfers before it on that stream have ended; while both communication streams carry a
//! transfer they share the link, each at half speed; a collective begins when
//! every member of its group has started it, and a `Recv` ends no earlier than the matching
//! `Send`. A transfer that a `Wait` ends runs beside the instructions up to that wait, which holds
//! the compute stream until the transfer has ended; any other transfer but a send holds it at
//! once (a send never waits). Kernels cost their roofline (`passes::cost::compute`), transfers
//! their alpha-beta time (`passes::cost::comm`). This lives in the binary because the backend must
//! not know the cost model and the passes cannot see `Program`.

use std::collections::{BTreeMap, HashMap, VecDeque};

use anyhow::{bail, Result};
use pleat_backend::memory::ElementSize;
use pleat_backend::overlap::{schedule_ranks, OverlapOptions, OverlapReport, Prefetch, StreamClocks};
use pleat_backend::transfers::{pair_transfers, TransferPairs};
use pleat_backend::{AttentionDims, Instr, Kernel, Program, TransferStream};
use pleat_passes::cost::comm::{self, Collective};
use pleat_passes::cost::compute::{OpClass, OpCost};
use pleat_passes::cost::layout::AxisSpan;
use pleat_passes::cost::HardwareSpec;

/// The streams of a rank: Chrome trace thread ids.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Stream {
    /// Kernels and loads.
    Compute = 0,
    /// Collectives, broadcasts, sends and receives.
    Comm = 1,
    /// Weight prefetches on the second communication stream (`TransferStream::Prefetch`).
    Prefetch = 2,
}

impl Stream {
    /// Whether it is a communication stream.
    pub fn is_comm(self) -> bool {
        self != Stream::Compute
    }
}

/// What one instruction does, for a trace slice.
#[derive(Clone, Debug, PartialEq)]
pub struct Work {
    /// The stream it runs on.
    pub stream: Stream,
    /// The op (`matmul`, `all_reduce`, `load`, ...).
    pub op: &'static str,
    /// The buffer it writes or sends (the IR value's name, which carries the layer).
    pub what: String,
    /// Bytes moved: a kernel's operands and result, a load's result, a transfer's message.
    pub bytes: u64,
    /// Floating-point operations (matmuls and attention; zero for the rest).
    pub flops: u64,
    /// The collective kind, for transfers.
    pub collective: Option<Collective>,
    /// The ranks taking part in a transfer (the group, or this rank and its peer).
    pub ranks: Vec<u32>,
}

impl Work {
    /// The slice name: op and buffer, as `matmul layer0.q`.
    pub fn name(&self) -> String {
        format!("{} {}", self.op, self.what)
    }
}

fn kernel_op(kernel: &Kernel) -> (&'static str, u64) {
    match kernel {
        Kernel::Embedding { .. } => ("embedding", 0),
        Kernel::RmsNorm { .. } => ("rms_norm", 0),
        Kernel::MatMul { m, n, k } => ("matmul", flops(&[2, *m, *n, *k])),
        Kernel::Rope { .. } => ("rope", 0),
        Kernel::Attention { dims: AttentionDims { batch, sq, sk, hq, head_dim, .. }, .. } => {
            ("attention", flops(&[4, *batch, *sq, *sk, *hq, *head_dim]))
        }
        Kernel::MergeAttention { .. } => ("merge_attention", 0),
        Kernel::SiluMul => ("silu_mul", 0),
        Kernel::Add => ("add", 0),
        Kernel::Sum => ("sum", 0),
        Kernel::Permute { .. } => ("permute", 0),
        Kernel::Slice { .. } => ("slice", 0),
        Kernel::Zeros => ("zeros", 0),
        Kernel::CrossEntropy { .. } => ("cross_entropy", 0),
        Kernel::CrossEntropyGrad { .. } => ("cross_entropy_grad", 0),
        Kernel::LossRowStats { .. } => ("loss_row_stats", 0),
        Kernel::CrossEntropyFromStats { .. } => ("cross_entropy_from_stats", 0),
        Kernel::CrossEntropyGradFromStats { .. } => ("cross_entropy_grad_from_stats", 0),
        Kernel::MatMulGradInput { m, n, k } => ("matmul_grad_input", flops(&[2, *m, *n, *k])),
        Kernel::MatMulGradWeight { m, n, k } => ("matmul_grad_weight", flops(&[2, *m, *n, *k])),
        Kernel::RmsNormGradInput { .. } => ("rms_norm_grad_input", 0),
        Kernel::RmsNormGradInputAdd { .. } => ("rms_norm_grad_input_add", 0),
        Kernel::RmsNormGradWeight { .. } => ("rms_norm_grad_weight", 0),
        Kernel::RopeGrad { .. } => ("rope_grad", 0),
        // Scores and the softmax's gradient (two products), then the gradient's own product.
        Kernel::AttentionGrad { dims: AttentionDims { batch, sq, sk, hq, head_dim, .. }, .. } => {
            ("attention_grad", flops(&[6, *batch, *sq, *sk, *hq, *head_dim]))
        }
        Kernel::SiluMulGradGate => ("silu_mul_grad_gate", 0),
        Kernel::SigmoidScale { .. } => ("sigmoid_scale", 0),
        Kernel::ExpertCounts { dims, .. } => ("expert_counts", flops(&[2, dims.rows, dims.experts, dims.hidden])),
        Kernel::RouterProbSum { dims } => ("router_prob_sum", flops(&[2, dims.rows, dims.experts, dims.hidden])),
        Kernel::RouterProbSumGrad { dims, .. } => {
            ("router_prob_sum_grad", flops(&[4, dims.rows, dims.experts, dims.hidden]))
        }
        Kernel::LoadBalancingLoss { .. } => ("load_balancing_loss", 0),
        Kernel::SigmoidScaleGradGate { .. } => ("sigmoid_scale_grad_gate", 0),
        // The router, then three GEMMs for the rows a balanced routing sends to the local experts.
        Kernel::MoeMlp { dims } => ("moe_mlp", moe_flops(dims)),
        // The forward recomputed, and the two products of each of its GEMMs' gradient.
        Kernel::MoeMlpGrad { dims, .. } => ("moe_mlp_grad", moe_flops(dims).saturating_mul(3)),
        Kernel::EmbeddingGrad { .. } => ("embedding_grad", 0),
        Kernel::SumLeading { .. } => ("sum_leading", 0),
    }
}

/// What instruction `instr` of `program` does; `None` for bookkeeping (`Output`, `Free`). A `Wait`
/// is compute-stream time spent waiting for a transfer.
pub fn describe(program: &Program, instr: &Instr) -> Option<Work> {
    let bytes_of = |ids: &[pleat_backend::BufferId]| ids.iter().map(|&id| program.buffer(id).bytes()).sum::<u64>();
    let name_of =
        |ids: &[pleat_backend::BufferId]| ids.first().map_or_else(String::new, |&id| program.buffer(id).name.clone());
    // A bucket's results by their first and last names.
    let bucket_name = |outs: &[pleat_backend::BufferId]| match outs {
        [first, .., last] => {
            format!("bucket of {}: {} .. {}", outs.len(), program.buffer(*first).name, program.buffer(*last).name)
        }
        _ => name_of(outs),
    };
    let transfer = |op: &'static str, kind: Collective, what: String, bytes: u64, ranks: Vec<u32>| Work {
        stream: Stream::Comm,
        op,
        what,
        bytes,
        flops: 0,
        collective: Some(kind),
        ranks,
    };
    let load = |out| Work {
        stream: Stream::Compute,
        op: "load",
        what: name_of(&[out]),
        bytes: bytes_of(&[out]),
        flops: 0,
        collective: None,
        ranks: Vec::new(),
    };
    let work = match instr {
        Instr::LoadParam { out, .. } | Instr::LoadTokens { out, .. } | Instr::LoadPositions { out, .. } => load(*out),
        Instr::Kernel { kernel, inputs, out } => {
            let (op, flops) = kernel_op(kernel);
            Work {
                stream: Stream::Compute,
                op,
                what: name_of(&[*out]),
                bytes: bytes_of(inputs) + bytes_of(&[*out]),
                flops,
                collective: None,
                ranks: Vec::new(),
            }
        }
        Instr::AllReduce { inputs, outs, group } => {
            transfer("all_reduce", Collective::AllReduce, bucket_name(outs), bytes_of(inputs), group.ranks.clone())
        }
        Instr::ReduceScatter { inputs, outs, group, .. } => transfer(
            "reduce_scatter",
            Collective::ReduceScatter,
            bucket_name(outs),
            bytes_of(inputs),
            group.ranks.clone(),
        ),
        Instr::AllGather { out, group, .. } => {
            transfer("all_gather", Collective::AllGather, name_of(&[*out]), bytes_of(&[*out]), group.ranks.clone())
        }
        Instr::AllToAll { input, out, group, .. } => {
            transfer("all_to_all", Collective::AllToAll, name_of(&[*out]), bytes_of(&[*input]), group.ranks.clone())
        }
        Instr::Broadcast { outs, group, .. } => {
            transfer("broadcast", Collective::Broadcast, name_of(outs), bytes_of(outs), group.ranks.clone())
        }
        Instr::Send { bufs, peer } => {
            transfer("send", Collective::SendRecv, name_of(bufs), bytes_of(bufs), vec![program.rank, *peer])
        }
        Instr::Recv { outs, peer } => {
            transfer("recv", Collective::SendRecv, name_of(outs), bytes_of(outs), vec![*peer, program.rank])
        }
        Instr::Relay { outs, from, to } => {
            transfer("relay", Collective::SendRecv, name_of(outs), bytes_of(outs), vec![*from, program.rank, *to])
        }
        // The rows a balanced routing sends away and gets back, and the experts' work between.
        Instr::ExpertDispatch { outs, wrts, group, dims, .. } => {
            let width = if wrts.is_empty() { dims.hidden + 1 } else { 2 * dims.hidden + 2 };
            let members = group.ranks.len().max(1) as u64;
            let away = dims.rows * dims.top_k * (members - 1) / members;
            let mut work = transfer(
                "expert_dispatch",
                Collective::AllToAll,
                name_of(outs),
                away * (width + dims.hidden) * 4,
                group.ranks.clone(),
            );
            // Under balanced routing each member's experts serve as many rows as it sends: the
            // kernel's flops with every expert local.
            let forward = moe_flops(&pleat_backend::MoeDims { local_experts: dims.experts, ..dims.clone() });
            work.flops = if wrts.is_empty() { forward } else { forward.saturating_mul(3) };
            work
        }
        Instr::Wait { handle } => Work {
            stream: Stream::Compute,
            op: "wait",
            what: name_of(handle),
            bytes: 0,
            flops: 0,
            collective: None,
            ranks: Vec::new(),
        },
        Instr::Output { .. } | Instr::Free { .. } => return None,
    };
    Some(match instr.transfer_stream() {
        TransferStream::Main => work,
        TransferStream::Prefetch => Work { stream: Stream::Prefetch, ..work },
    })
}

/// How a group of global ranks sits on nodes of `gpus_per_node` (ranks fill nodes in order).
fn span_of(ranks: &[u32], gpus_per_node: u64) -> AxisSpan {
    let mut nodes: Vec<u64> = ranks.iter().map(|&rank| u64::from(rank) / gpus_per_node.max(1)).collect();
    nodes.sort_unstable();
    nodes.dedup();
    let node_count = nodes.len().max(1) as u64;
    AxisSpan { ranks_per_node: (ranks.len() as u64).div_ceil(node_count).max(1), nodes: node_count }
}

/// Predicted seconds of `work` on `hw`, for elements of `dtype_bytes`.
pub fn seconds(work: &Work, hw: &HardwareSpec, dtype_bytes: u64) -> f64 {
    match work.collective {
        Some(kind) => {
            let wire = comm::time(kind, work.bytes as f64, span_of(&work.ranks, hw.gpus_per_node), hw);
            // An expert dispatch runs its experts' GEMMs between its exchanges.
            let compute = match work.flops {
                0 => 0.0,
                flops => OpCost { what: work.op, class: OpClass::MatMul, flops: flops as f64, bytes: 0.0 }
                    .time(hw, dtype_bytes),
            };
            wire + compute
        }
        None => {
            let class = match work.op {
                "matmul" => OpClass::MatMul,
                "attention" => OpClass::Attention,
                _ => OpClass::MemoryBound,
            };
            OpCost { what: work.op, class, flops: work.flops as f64, bytes: work.bytes as f64 }.time(hw, dtype_bytes)
        }
    }
}

/// Predicted seconds of `instr` of `program`, which does `work`, at the dtype it writes (or reads).
fn instr_seconds(program: &Program, instr: &Instr, work: &Work, hw: &HardwareSpec) -> f64 {
    let dtype_bytes =
        instr.outs().first().or(instr.inputs().first()).map_or(4, |&id| program.buffer(id).dtype.size_bytes());
    seconds(work, hw, dtype_bytes)
}

/// Schedules every program for overlap (`pleat_backend::overlap::schedule_ranks`, weights
/// prefetched as `prefetch` says where every rank moves them alike), its choices driven by `hw`'s
/// predicted seconds.
pub fn overlap_programs(programs: &[Program], hw: &HardwareSpec, prefetch: Prefetch) -> Result<Vec<Program>> {
    Ok(overlap_programs_reported(programs, hw, prefetch)?.into_iter().map(|(program, _)| program).collect())
}

/// `programs` as a CPU runtime is to run them: scheduled for overlap with the built-in `cpu`
/// costs, weights prefetched as `prefetch` says, or kept as lowered with `no_overlap`.
pub fn overlap_for_cpu(programs: Vec<Program>, no_overlap: bool, prefetch: Prefetch) -> Result<Vec<Program>> {
    if no_overlap {
        Ok(programs)
    } else {
        overlap_programs(&programs, &HardwareSpec::builtin("cpu")?, prefetch)
    }
}

/// As [`overlap_programs`], the weights prefetched as `prefetch` says, each program with what the
/// scheduler did.
pub fn overlap_programs_reported(
    programs: &[Program],
    hw: &HardwareSpec,
    prefetch: Prefetch,
) -> Result<Vec<(Program, OverlapReport)>> {
    let seconds = |program: &Program, instr: &Instr| {
        describe(program, instr).map_or(0.0, |work| instr_seconds(program, instr, &work, hw))
    };
    let options = OverlapOptions { seconds: &seconds, memory_budget: None, sizing: ElementSize::Declared, prefetch };
    Ok(schedule_ranks(programs, &options)?)
}

/// One predicted slice: instruction `instr` of a rank from `start_s` to `end_s`.
#[derive(Clone, Debug, PartialEq)]
pub struct Predicted {
    /// The instruction's index in the program.
    pub instr: usize,
    /// What it does.
    pub work: Work,
    /// Start, seconds from the step's beginning.
    pub start_s: f64,
    /// End, seconds.
    pub end_s: f64,
    /// Seconds the compute stream was held waiting for communication here: a wait's stall, or a
    /// blocking transfer's time, each from when every rank taking part had reached the transfer
    /// (never the time spent waiting for a late peer's compute: a pipeline's bubble, say). The
    /// time a transfer queues behind others on a stream counts: it is communication.
    pub exposed_s: f64,
}

struct RankState {
    pc: usize,
    compute_free: f64,
    /// The communication streams' clocks.
    streams: StreamClocks,
    pairs: TransferPairs,
    transfer_end: HashMap<usize, f64>,
    /// Per transfer instruction: when every rank taking part had issued it, so that only a late
    /// peer's compute, not its streams' queues, is excluded from the exposed time.
    transfer_ready: HashMap<usize, f64>,
    /// The relays' forwards: the seconds each one's stream carries on after its message is in.
    forward_s: HashMap<usize, f64>,
    /// Per stream and group: the collectives entered so far.
    group_calls: HashMap<(TransferStream, Vec<u32>), usize>,
    slices: Vec<Predicted>,
    /// Per transfer instruction: its slice in `slices`.
    slice_of: HashMap<usize, usize>,
}

/// A rank's entry into a collective: when its stream could start it and when its compute stream
/// issued it.
struct Entered {
    arrival: f64,
    issue: f64,
}

/// A point-to-point message in flight: when its sender's side was ready (issued, or a relay's hop
/// ready), and when it occupies the link.
struct Message {
    ready: f64,
    start: f64,
    end: f64,
}

/// What a prediction sums to.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PredictedStep {
    /// The step's time: the last rank's end.
    pub step_s: f64,
    /// The most communication seconds any rank's compute stream waited for.
    pub exposed_comm_s: f64,
    /// The most seconds of communication any rank's stream ran.
    pub comm_s: f64,
}

/// Sums `timelines` (from [`predict`]).
pub fn summarize(timelines: &[Vec<Predicted>]) -> PredictedStep {
    let most = |of: &dyn Fn(&Predicted) -> f64| {
        timelines.iter().map(|slices| slices.iter().map(of).sum::<f64>()).fold(0.0, f64::max)
    };
    PredictedStep {
        step_s: timelines.iter().flatten().map(|slice| slice.end_s).fold(0.0, f64::max),
        exposed_comm_s: most(&|slice| slice.exposed_s),
        comm_s: most(&|slice| if slice.work.stream.is_comm() { slice.end_s - slice.start_s } else { 0.0 }),
    }
}

/// The predicted timeline of every rank's program (in rank order), each rank's slices in program
/// order. Fails when the programs cannot all finish (a collective or receive nobody matches).
pub fn predict(programs: &[Program], hw: &HardwareSpec) -> Result<Vec<Vec<Predicted>>> {
    let mut states = Vec::with_capacity(programs.len());
    for program in programs {
        states.push(RankState {
            pc: 0,
            compute_free: 0.0,
            streams: StreamClocks::default(),
            pairs: pair_transfers(program)?,
            transfer_end: HashMap::new(),
            transfer_ready: HashMap::new(),
            forward_s: HashMap::new(),
            group_calls: HashMap::new(),
            slices: Vec::new(),
            slice_of: HashMap::new(),
        });
    }
    // (stream, group, call index) -> each member's entry; (sender, receiver) -> sends in order.
    let mut arrivals: BTreeMap<(TransferStream, Vec<u32>, usize), BTreeMap<u32, Entered>> = BTreeMap::new();
    let mut messages: HashMap<(u32, u32), VecDeque<Message>> = HashMap::new();
    loop {
        let mut progressed = false;
        for (rank, program) in programs.iter().enumerate() {
            let state = &mut states[rank];
            while let Some(instr) = program.instructions.get(state.pc) {
                let Some(work) = describe(program, instr) else {
                    state.pc += 1;
                    progressed = true;
                    continue;
                };
                let cost = instr_seconds(program, instr, &work, hw);
                let issue = state.compute_free;
                let stream = instr.transfer_stream();
                let arrival = issue.max(state.streams.free(stream));
                // A relay's forward: the seconds its stream carries on after the message is in.
                let mut forward_s = 0.0;
                let mut ready = issue;
                let (start_s, end_s) = match instr {
                    Instr::AllReduce { group, .. }
                    | Instr::ReduceScatter { group, .. }
                    | Instr::AllGather { group, .. }
                    | Instr::AllToAll { group, .. }
                    | Instr::Broadcast { group, .. } => {
                        let key = (stream, group.ranks.clone());
                        let call = *state.group_calls.get(&key).unwrap_or(&0);
                        let members = arrivals.entry((stream, group.ranks.clone(), call)).or_default();
                        members.insert(program.rank, Entered { arrival, issue });
                        if group.ranks.iter().any(|member| !members.contains_key(member)) {
                            break;
                        }
                        state.group_calls.insert(key, call + 1);
                        ready = members.values().map(|member| member.issue).fold(0.0, f64::max);
                        let start = members.values().map(|member| member.arrival).fold(0.0, f64::max);
                        (start, start + cost)
                    }
                    Instr::Send { peer, .. } => {
                        messages.entry((program.rank, *peer)).or_default().push_back(Message {
                            ready: issue,
                            start: arrival,
                            end: arrival + cost,
                        });
                        (arrival, arrival + cost)
                    }
                    Instr::Recv { peer: from, .. } | Instr::Relay { from, .. } => {
                        let Some(sent) = messages.get_mut(&(*from, program.rank)).and_then(VecDeque::pop_front) else {
                            break;
                        };
                        ready = issue.max(sent.ready);
                        let start = arrival.max(sent.start);
                        // The message is queued once sent: a late receiver finds it there.
                        let arrived = start.max(sent.end);
                        if let Instr::Relay { to, .. } = instr {
                            // The forward is ready when this hop was: the wait for the message
                            // before it is the ring's communication.
                            messages.entry((program.rank, *to)).or_default().push_back(Message {
                                ready,
                                start: arrived,
                                end: arrived + cost,
                            });
                            forward_s = cost;
                        }
                        (start, arrived + forward_s)
                    }
                    Instr::Wait { .. } => {
                        let ended = state
                            .pairs
                            .start_of
                            .get(&state.pc)
                            .and_then(|start| state.transfer_end.get(start))
                            .copied()
                            .unwrap_or(issue);
                        (issue, issue.max(ended))
                    }
                    _ => (issue, issue + cost),
                };
                let mut exposed_s = 0.0;
                let mut end_s = end_s;
                if instr.is_transfer() {
                    // The link is shared with the other stream's transfers in flight.
                    let (ends, stretched) = state.streams.run(stream, state.pc, start_s, end_s - start_s);
                    end_s = ends;
                    for (transfer, start, end) in stretched {
                        let forward = state.forward_s.get(&transfer).copied().unwrap_or(0.0);
                        state.transfer_end.insert(transfer, end - forward);
                        if let Some(slice) = state.slice_of.get(&transfer).and_then(|&at| state.slices.get_mut(at)) {
                            (slice.start_s, slice.end_s) = (start, end);
                        }
                    }
                    state.slice_of.insert(state.pc, state.slices.len());
                    // A relay's wait (or, blocking, the compute stream) needs the message, not the
                    // forward after it.
                    let delivered = end_s - forward_s;
                    if forward_s > 0.0 {
                        state.forward_s.insert(state.pc, forward_s);
                    }
                    state.transfer_end.insert(state.pc, delivered);
                    state.transfer_ready.insert(state.pc, ready);
                    let blocking = !state.pairs.wait_of.contains_key(&state.pc) && !matches!(instr, Instr::Send { .. });
                    if blocking {
                        // Waiting for a peer to reach the transfer is its lateness (a pipeline's
                        // bubble, say), not communication.
                        exposed_s = (delivered - ready).max(0.0);
                        state.compute_free = delivered;
                    }
                } else {
                    if matches!(instr, Instr::Wait { .. }) {
                        let transfer_ready = state
                            .pairs
                            .start_of
                            .get(&state.pc)
                            .and_then(|start| state.transfer_ready.get(start))
                            .copied()
                            .unwrap_or(start_s);
                        exposed_s = (end_s - start_s.max(transfer_ready)).max(0.0);
                    }
                    state.compute_free = end_s;
                }
                // A wait that did not stall is no slice.
                if !matches!(instr, Instr::Wait { .. }) || end_s > start_s {
                    state.slices.push(Predicted { instr: state.pc, work, start_s, end_s, exposed_s });
                }
                state.pc += 1;
                progressed = true;
            }
        }
        if states.iter().zip(programs).all(|(state, program)| state.pc == program.instructions.len()) {
            return Ok(states.into_iter().map(|state| state.slices).collect());
        }
        if !progressed {
            let stuck: Vec<String> = states
                .iter()
                .zip(programs)
                .filter(|(state, program)| state.pc < program.instructions.len())
                .map(|(state, program)| format!("rank {} at instruction {}", program.rank, state.pc))
                .collect();
            bail!(crate::usage::UsageError::ProgramsStuck { stuck });
        }
    }
}

/// A mixture-of-experts kernel's flops when routing is balanced: the router on every row, and each
/// of the `rows·top_k/experts` rows an expert expects through its three projections.
fn moe_flops(dims: &pleat_backend::MoeDims) -> u64 {
    let routed_rows = flops(&[dims.rows, dims.top_k, dims.local_experts]) / dims.experts.max(1);
    flops(&[2, dims.rows, dims.experts, dims.hidden]).saturating_add(flops(&[6, routed_rows, dims.hidden, dims.ffn]))
}

/// The product of `factors`, saturating: a kernel's flops on any shape a program may hold (a
/// sequence of 2^32 tokens makes attention's exceed `u64`); the cost model reads them as `f64`.
fn flops(factors: &[u64]) -> u64 {
    factors.iter().fold(1, |product: u64, &factor| product.saturating_mul(factor))
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_backend::{Buffer, BufferId, BufferKind, Group, FORMAT_VERSION};
    use pleat_ir::entity::EntityRef;
    use pleat_ir::DType;

    fn buffer(name: &str, shape: &[u64], kind: BufferKind) -> Buffer {
        Buffer { name: name.into(), dtype: DType::F32, shape: shape.to_vec(), kind }
    }

    fn id(index: usize) -> BufferId {
        BufferId::new(index)
    }

    fn program(rank: u32, buffers: Vec<Buffer>, instructions: Vec<Instr>) -> Program {
        Program {
            format_version: FORMAT_VERSION,
            model: "hand".into(),
            mesh: "tp=2".into(),
            rank,
            world_size: 2,
            tokens_shape: vec![1, 64],
            buffers,
            instructions,
        }
    }

    fn load(out: usize) -> Instr {
        Instr::LoadParam { out: id(out), name: "w".into(), shape: vec![64, 64], region: vec![(0, 64), (0, 64)] }
    }

    /// Rank r: [rank 1 only: an extra load], load x, load w, matmul, all-reduce, add, free.
    fn tp_pair() -> Vec<Program> {
        let buffers = || {
            vec![
                buffer("x", &[64, 64], BufferKind::Param),
                buffer("layer0.w", &[64, 64], BufferKind::Param),
                buffer("layer0.y", &[64, 64], BufferKind::Activation),
                buffer("layer0.y.all_reduce", &[64, 64], BufferKind::Activation),
                buffer("layer0.out", &[64, 64], BufferKind::Activation),
                buffer("extra", &[64, 64], BufferKind::Param),
            ]
        };
        let group = Group { axis: "tp".into(), ranks: vec![0, 1] };
        let body = |extra: bool| {
            let mut instructions = if extra { vec![load(5)] } else { Vec::new() };
            instructions.extend([
                load(0),
                load(1),
                Instr::Kernel {
                    kernel: Kernel::MatMul { m: 64, n: 64, k: 64 },
                    inputs: vec![id(0), id(1)],
                    out: id(2),
                },
                Instr::AllReduce { inputs: vec![id(2)], outs: vec![id(3)], group: group.clone() },
                Instr::Kernel { kernel: Kernel::Add, inputs: vec![id(3), id(0)], out: id(4) },
                Instr::Free { buf: id(2) },
            ]);
            instructions
        };
        vec![program(0, buffers(), body(false)), program(1, buffers(), body(true))]
    }

    #[test]
    fn timeline_matches_a_hand_computed_roofline_and_alpha_beta() {
        let hw = HardwareSpec::builtin("cpu").unwrap();
        let timelines = predict(&tp_pair(), &hw).unwrap();
        // Independent arithmetic from the cpu table: 192 GFLOP/s, 20 GB/s HBM, 5 GB/s links, 5 us.
        let tile = 64.0 * 64.0 * 4.0;
        let load = tile / (20e9 * 0.8);
        let matmul = (2.0 * 64.0f64.powi(3) / (192e9 * 0.75)).max(3.0 * tile / (20e9 * 0.8));
        let all_reduce = 2.0 * 0.5 * tile / (5e9 * 0.8) + 2.0 * 5e-6;
        let add = 3.0 * tile / (20e9 * 0.8);
        let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-12, "got {got}, want {want}");
        // Rank 1 does one more load, so the all-reduce starts when rank 1 arrives, on both.
        let start = 3.0 * load + matmul;
        for (rank, timeline) in timelines.iter().enumerate() {
            let ops: Vec<&str> = timeline.iter().map(|slice| slice.work.op).collect();
            let mut want_ops = vec!["load"; 2 + rank];
            want_ops.extend(["matmul", "all_reduce", "add"]);
            assert_eq!(ops, want_ops, "the free is not a slice");
            let reduce = &timeline[timeline.len() - 2];
            assert_eq!(reduce.work.stream, Stream::Comm);
            close(reduce.start_s, start);
            close(reduce.end_s, start + all_reduce);
            let last = timeline.last().unwrap();
            close(last.start_s, start + all_reduce);
            close(last.end_s, start + all_reduce + add);
        }
        assert_eq!(timelines[0][2].work.name(), "matmul layer0.y");
        assert_eq!(timelines[0][2].work.flops, 2 * 64 * 64 * 64);
    }

    /// A block `w`, the copy of it a message brings, and a matmul's result.
    fn message_buffers() -> Vec<Buffer> {
        vec![
            buffer("layer0.w", &[64, 64], BufferKind::Param),
            buffer("layer0.w.peer", &[64, 64], BufferKind::InFlight),
            buffer("layer0.x", &[64, 64], BufferKind::Activation),
        ]
    }

    /// `x = w·w` on [`message_buffers`].
    fn square_matmul() -> Instr {
        Instr::Kernel { kernel: Kernel::MatMul { m: 64, n: 64, k: 64 }, inputs: vec![id(0), id(0)], out: id(2) }
    }

    #[test]
    fn a_recv_ends_when_its_send_does_and_compute_overlaps_the_send() {
        let hw = HardwareSpec::builtin("cpu").unwrap();
        let sender =
            program(0, message_buffers(), vec![load(0), Instr::Send { bufs: vec![id(0)], peer: 1 }, square_matmul()]);
        let receiver = program(1, message_buffers(), vec![Instr::Recv { outs: vec![id(1)], peer: 0 }, load(0)]);
        let timelines = predict(&[sender, receiver], &hw).unwrap();
        let tile = 64.0 * 64.0 * 4.0;
        let load = tile / (20e9 * 0.8);
        let send = tile / (5e9 * 0.8) + 5e-6;
        let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-12, "got {got}, want {want}");
        let (send_slice, matmul_slice) = (&timelines[0][1], &timelines[0][2]);
        close(send_slice.start_s, load);
        close(send_slice.end_s, load + send);
        // A send never waits: the matmul runs beside it.
        close(matmul_slice.start_s, load);
        let recv = &timelines[1][0];
        close(recv.start_s, load);
        close(recv.end_s, load + send);
        // The receive is blocking: the receiver's load waits for it, but only the message's own
        // time is communication; the sender's load before it is the sender's lateness.
        close(recv.exposed_s, send);
        close(timelines[1][1].start_s, load + send);
    }

    #[test]
    fn a_receive_queued_behind_its_own_send_is_exposed_communication() {
        // A ring hop: each rank sends its block and then receives its neighbour's on the same
        // stream. The receive starts when the send has left, so the compute stream waits for
        // both; the peer reached the hop as early, so none of it is a late peer's.
        let hw = HardwareSpec::builtin("cpu").unwrap();
        let hop = |rank: u32| {
            let peer = 1 - rank;
            program(
                rank,
                message_buffers(),
                vec![load(0), Instr::Send { bufs: vec![id(0)], peer }, Instr::Recv { outs: vec![id(1)], peer }],
            )
        };
        let timelines = predict(&[hop(0), hop(1)], &hw).unwrap();
        let tile = 64.0 * 64.0 * 4.0;
        let send = tile / (5e9 * 0.8) + 5e-6;
        let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-12, "got {got}, want {want}");
        for timeline in &timelines {
            let recv = timeline.iter().find(|slice| slice.work.op == "recv").unwrap();
            close(recv.exposed_s, send);
        }
        close(summarize(&timelines).exposed_comm_s, send);
    }

    #[test]
    fn a_transfer_runs_beside_the_instructions_before_its_wait() {
        let hw = HardwareSpec::builtin("cpu").unwrap();
        let scheduled = |rank: u32| {
            let mut instructions = tp_pair()[rank as usize].instructions.clone();
            // load x, load w, matmul, all-reduce, [matmul y2], wait, add, free.
            let at = instructions.iter().position(|instr| matches!(instr, Instr::AllReduce { .. })).unwrap();
            instructions.insert(
                at + 1,
                Instr::Kernel {
                    kernel: Kernel::MatMul { m: 64, n: 64, k: 64 },
                    inputs: vec![id(0), id(1)],
                    out: id(5),
                },
            );
            instructions.insert(at + 2, Instr::Wait { handle: vec![id(3)] });
            let mut program = tp_pair()[rank as usize].clone();
            program.instructions = instructions;
            program
        };
        let timelines = predict(&[scheduled(0), scheduled(1)], &hw).unwrap();
        let tile = 64.0 * 64.0 * 4.0;
        let load = tile / (20e9 * 0.8);
        let matmul = (2.0 * 64.0f64.powi(3) / (192e9 * 0.75)).max(3.0 * tile / (20e9 * 0.8));
        let all_reduce = 2.0 * 0.5 * tile / (5e9 * 0.8) + 2.0 * 5e-6;
        let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-12, "got {got}, want {want}");
        // Rank 1 loads once more; the all-reduce starts when it arrives, and each rank's second
        // matmul runs beside it; the wait holds the compute stream until the all-reduce ends.
        let start = 3.0 * load + matmul;
        for timeline in &timelines {
            let ops: Vec<&str> = timeline.iter().map(|slice| slice.work.op).collect();
            let reduce = timeline.iter().find(|slice| slice.work.op == "all_reduce").unwrap();
            close(reduce.start_s, start);
            close(reduce.end_s, start + all_reduce);
            let wait = timeline.iter().find(|slice| slice.work.op == "wait").unwrap();
            close(wait.end_s, start + all_reduce);
            close(wait.exposed_s, wait.end_s - wait.start_s);
            let last = timeline.last().unwrap();
            assert_eq!(last.work.op, "add", "{ops:?}");
            close(last.start_s, start + all_reduce);
        }
        let step = summarize(&timelines);
        // Rank 0 computes its second matmul from 2·load + matmul; rank 1 a load later.
        close(step.exposed_comm_s, all_reduce - matmul + load);
        assert!(step.step_s < summarize(&predict(&tp_pair(), &hw).unwrap()).step_s + matmul - 1e-9);
    }

    /// A prefetch on the second stream and an all-reduce on the first, started together: the link
    /// is shared while both run, so each is late by the time they share; on one stream the gather
    /// would queue behind the all-reduce instead.
    #[test]
    fn two_streams_share_the_link_while_both_carry_a_transfer() {
        let hw = HardwareSpec::builtin("cpu").unwrap();
        let programs = |stream: TransferStream| {
            (0..2)
                .map(|rank| {
                    let buffers = vec![
                        buffer("a", &[64, 64], BufferKind::Param),
                        buffer("b", &[64, 64], BufferKind::Param),
                        buffer("a.sum", &[64, 64], BufferKind::Activation),
                        buffer("b.gathered", &[128, 64], BufferKind::Activation),
                    ];
                    let load = |out: usize, name: &str| Instr::LoadParam {
                        out: id(out),
                        name: name.into(),
                        shape: vec![64, 64],
                        region: vec![(0, 64), (0, 64)],
                    };
                    let tp = Group { axis: "tp".into(), ranks: vec![0, 1] };
                    program(
                        rank,
                        buffers,
                        vec![
                            load(0, "a"),
                            load(1, "b"),
                            Instr::AllReduce { inputs: vec![id(0)], outs: vec![id(2)], group: tp.clone() },
                            Instr::AllGather { input: id(1), out: id(3), group: tp, dim: 0, stream },
                            Instr::Wait { handle: vec![id(2)] },
                            Instr::Wait { handle: vec![id(3)] },
                        ],
                    )
                })
                .collect::<Vec<_>>()
        };
        let cost = |programs: &[Program], at: usize| {
            let instr = &programs[0].instructions[at];
            instr_seconds(&programs[0], instr, &describe(&programs[0], instr).unwrap(), &hw)
        };
        let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-12, "got {got}, want {want}");
        for (stream, track) in [(TransferStream::Prefetch, Stream::Prefetch), (TransferStream::Main, Stream::Comm)] {
            let programs = programs(stream);
            let (reduce, gather) = (cost(&programs, 2), cost(&programs, 3));
            assert!(reduce > 0.0 && gather > 0.0);
            let start = cost(&programs, 0) + cost(&programs, 1);
            let shared = reduce.min(gather);
            let timelines = predict(&programs, &hw).unwrap();
            for timeline in &timelines {
                let slice = |op: &str| timeline.iter().find(|slice| slice.work.op == op).unwrap();
                assert_eq!(slice("all_gather").work.stream, track);
                close(slice("all_reduce").start_s, start);
                if stream == TransferStream::Prefetch {
                    close(slice("all_gather").start_s, start);
                    close(slice("all_reduce").end_s, start + reduce + shared);
                    close(slice("all_gather").end_s, start + gather + shared);
                } else {
                    close(slice("all_reduce").end_s, start + reduce);
                    close(slice("all_gather").start_s, start + reduce);
                    close(slice("all_gather").end_s, start + reduce + gather);
                }
            }
            // Shared or queued, the link carries both: the step ends when both are done.
            close(summarize(&timelines).step_s, start + reduce + gather);
        }
    }

    /// A three-rank chain: rank 0 sends its block, rank 1 relays it to rank 2 while it computes,
    /// and waits for it only after its matmul.
    #[test]
    fn a_relays_wait_ends_at_the_arrival_and_its_forward_follows_on_the_stream() {
        let hw = HardwareSpec::builtin("cpu").unwrap();
        let sender = program(0, message_buffers(), vec![load(0), Instr::Send { bufs: vec![id(0)], peer: 1 }]);
        let relay = program(
            1,
            message_buffers(),
            vec![
                load(0),
                Instr::Relay { outs: vec![id(1)], from: 0, to: 2 },
                square_matmul(),
                Instr::Wait { handle: vec![id(1)] },
            ],
        );
        let receiver = program(2, message_buffers(), vec![Instr::Recv { outs: vec![id(1)], peer: 1 }]);
        let timelines = predict(&[sender, relay, receiver], &hw).unwrap();
        let tile = 64.0 * 64.0 * 4.0;
        let load = tile / (20e9 * 0.8);
        let message = tile / (5e9 * 0.8) + 5e-6;
        let close = |got: f64, want: f64| assert!((got - want).abs() < 1e-12, "got {got}, want {want}");
        let relayed = &timelines[1][1];
        assert_eq!(relayed.work.name(), "relay layer0.w.peer");
        // In from rank 0 at load + message, then on to rank 2 for another message's time.
        close(relayed.start_s, load);
        close(relayed.end_s, load + 2.0 * message);
        // The matmul runs beside it; the wait ends at the arrival, not after the forward.
        close(timelines[1][2].start_s, load);
        let matmul_end = timelines[1][2].end_s;
        match timelines[1].get(3) {
            Some(wait) => close(wait.end_s, load + message),
            None => assert!(matmul_end >= load + message, "no stall, so the message was in"),
        }
        // Rank 2 gets the message when the forward ends.
        close(timelines[2][0].end_s, load + 2.0 * message);
    }

    #[test]
    fn a_recv_nobody_sends_is_an_error() {
        let buffers = vec![buffer("layer0.w.peer", &[64, 64], BufferKind::InFlight)];
        let lonely = program(0, buffers.clone(), vec![Instr::Recv { outs: vec![id(0)], peer: 1 }]);
        let idle = program(1, buffers, Vec::new());
        let err = predict(&[lonely, idle], &HardwareSpec::builtin("cpu").unwrap()).unwrap_err();
        assert!(err.to_string().contains("rank 0 at instruction 0"), "{err}");
    }

    #[test]
    fn groups_across_nodes_span_them() {
        assert_eq!(span_of(&[0, 1, 2, 3], 8), AxisSpan { ranks_per_node: 4, nodes: 1 });
        assert_eq!(span_of(&[0, 8, 16, 24], 8), AxisSpan { ranks_per_node: 1, nodes: 4 });
        assert_eq!(span_of(&[6, 7, 8, 9], 8), AxisSpan { ranks_per_node: 2, nodes: 2 });
    }
}
