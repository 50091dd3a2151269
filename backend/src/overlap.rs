//! The overlap scheduler: reorders one rank's program so that its transfers run beside its
//! compute, each started as early as its operands allow and waited for as late as its first
//! reader allows, within a memory budget.
//!
//! A rank runs two streams: the compute stream runs the program's instructions in order, and the
//! communication stream runs the transfers they start, one after another, in the order they were
//! started (`crate::transfers`). With [`Prefetch::OwnStream`] a second communication stream runs
//! the weight prefetches, sharing the links with the first. Lowering writes every transfer
//! blocking, at the point its result is first needed. [`schedule`] turns each into a start and a
//! `Wait` and list-schedules the dependency graph over the streams, driven by the cost model's
//! predicted seconds:
//!
//! - the transfers keep their relative order, so every rank still issues its collectives and
//!   messages in the order its peers expect (the matching check sees the same sequence), and a
//!   start is issued as soon as its operands exist and the transfer before it was issued;
//! - of the instructions that can run at the current simulated time, a start goes first (it costs
//!   the compute stream nothing), then the first in the lowered order (which frees each activation
//!   soon after making it). A `Wait` is chosen only when nothing else can run or fits, and then the
//!   one the earliest instruction still to come needs, so it lands right before its first reader
//!   whatever the predicted seconds; the seconds decide when a start can issue (its operands' and
//!   a prefetch's stream's time) and so how much runs beside each transfer;
//! - a choice that would take the live bytes (buffers, and the staging copies of transfers in
//!   flight, as `crate::memory::plan` counts them) over the budget is deferred while another
//!   choice fits;
//! - every `Free` is placed right after the buffer's last use, its transfer's wait included.
//!
//! What this gives, with no pattern written for it: a TSP ring's next shard received while the
//! current one's GEMM runs (double buffering), a gradient reduced while the rest of the backward
//! runs, and, with a [`Prefetch`], the next owner's attention weights broadcast while the
//! current owner's attention runs and a ZeRO-3 parameter gathered while the previous layer runs.
//! Reordering never changes a number: every instruction reads what it read before, and the
//! transfers of each stream keep their order.

use std::collections::{HashMap, HashSet};

use crate::error::{Error, Result};
use crate::memory::{element_bytes, plan, staging_of, ElementSize};
use crate::program::{BufferId, Instr, Program, TransferStream};
use crate::range_max::RangeMax;

/// How [`schedule`] weighs and bounds its choices.
#[derive(Clone, Copy)]
pub struct OverlapOptions<'a> {
    /// Predicted seconds of an instruction of the program: a kernel's or a load's on the compute
    /// stream, a transfer's on the communication stream.
    pub seconds: &'a dyn Fn(&Program, &Instr) -> f64,
    /// The most bytes live at once, in `sizing`'s bytes. `None`: the unscheduled program's peak
    /// plus its largest transfer (results and staging), room for one transfer ahead.
    pub memory_budget: Option<u64>,
    /// Bytes an element, for the budget.
    pub sizing: ElementSize,
    /// Whether and where broadcasts and all-gathers of weights (whose operands are only loaded
    /// parameters: TSP's owner blocks, ZeRO-3's parameter shards) start ahead of the transfers
    /// before them, in their own order. Every rank must then make the same choices, which
    /// [`schedule_ranks`] checks (`crate::verify_collectives`) and, failing that, schedules again
    /// without prefetching.
    pub prefetch: Prefetch,
}

/// Where [`schedule`] moves weight prefetches.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Prefetch {
    /// Nowhere: every transfer keeps its place among the others.
    Off,
    /// Ahead on the one communication stream, each only when that stream is idle (queued behind
    /// other transfers it would delay them): for a runtime with one stream.
    MainStream,
    /// Ahead on the rank's second stream (`TransferStream::Prefetch`), each once the previous
    /// prefetch has ended. The two streams share the rank's links: while both carry a transfer,
    /// each moves at half the speed (processor sharing, as the threads communicator's paced link
    /// interleaves their messages).
    OwnStream,
}

/// The clocks of a rank's two communication streams, which share its links: while both carry a
/// transfer each moves at half speed (processor sharing), so a transfer beginning beside the
/// other stream's ends later by the time they share, and so does each of the other's in flight.
/// With one stream in use nothing is shared. The scheduler and the binary's predictor both cost
/// the streams with it.
#[derive(Clone, Debug, Default)]
pub struct StreamClocks {
    /// Per stream (main, prefetch): when its last transfer ends.
    free: [f64; 2],
    /// Per stream: its transfers that may still be in flight, in order, with their starts and
    /// ends.
    in_flight: [Vec<(usize, f64, f64)>; 2],
}

impl StreamClocks {
    fn slot(stream: TransferStream) -> usize {
        usize::from(stream == TransferStream::Prefetch)
    }

    /// When `stream`'s last transfer ends.
    pub fn free(&self, stream: TransferStream) -> f64 {
        self.free[Self::slot(stream)]
    }

    /// Runs transfer `id`, of `seconds` alone, on `stream` from `begins` (no earlier than
    /// [`StreamClocks::free`]); returns when it ends, and the other stream's transfers it slowed
    /// with their new starts and ends.
    ///
    /// Each second the two streams share delays one of the other stream's transfers in flight by a
    /// second, the first of them first (processor sharing: both at half speed), and a transfer's
    /// delay delays the start of the ones queued after it, as a stream starts nothing before its
    /// previous transfer has ended.
    pub fn run(
        &mut self,
        stream: TransferStream,
        id: usize,
        begins: f64,
        seconds: f64,
    ) -> (f64, Vec<(usize, f64, f64)>) {
        let (own, other) = (Self::slot(stream), 1 - Self::slot(stream));
        let shared = (self.free[other] - begins).clamp(0.0, seconds.max(0.0));
        self.in_flight[other].retain(|&(_, _, end)| end > begins);
        let mut stretched = Vec::new();
        if shared > 0.0 {
            let (mut shared_left, mut previous_end) = (shared, f64::NEG_INFINITY);
            for (transfer, start, end) in &mut self.in_flight[other] {
                let delay = (*end - start.max(begins)).max(0.0).min(shared_left);
                shared_left -= delay;
                let from = start.max(previous_end);
                (*start, *end) = (from, from + (*end - *start) + delay);
                previous_end = *end;
                self.free[other] = self.free[other].max(*end);
                stretched.push((*transfer, *start, *end));
            }
        }
        let ends = begins + seconds + shared;
        self.free[own] = ends;
        self.in_flight[own].push((id, begins, ends));
        (ends, stretched)
    }
}

/// What [`schedule`] did to one program.
#[derive(Clone, Debug, PartialEq)]
pub struct OverlapReport {
    /// Transfers in the program.
    pub transfers: usize,
    /// Transfers with at least one instruction other than a `Free` between start and wait.
    pub overlapped: usize,
    /// The budget the schedule kept to.
    pub budget_bytes: u64,
    /// The peak of the program as lowered, in the budget's bytes.
    pub peak_before_bytes: u64,
    /// The peak of the scheduled program.
    pub peak_after_bytes: u64,
    /// This rank's predicted time with every transfer blocking (peers assumed ready).
    pub blocking_s: f64,
    /// This rank's predicted time as scheduled (peers assumed ready).
    pub scheduled_s: f64,
}

/// A node of the dependency graph: an instruction of the program as lowered, or the wait of a
/// transfer. Node `2i` is instruction `i`; node `2i + 1` is its wait, when it is a transfer.
type Node = usize;

fn run_node(instr: usize) -> Node {
    2 * instr
}
fn wait_node(instr: usize) -> Node {
    2 * instr + 1
}

/// The dependency graph of a program's instructions (frees and waits left out).
struct Graph<'a> {
    instrs: Vec<&'a Instr>,
    /// Per node: the nodes it waits for.
    deps: Vec<Vec<Node>>,
    /// Per node: the buffers whose last use it may be.
    uses: Vec<Vec<BufferId>>,
    /// Per buffer: how many nodes use it.
    use_count: HashMap<BufferId, usize>,
    /// Per instruction: whether it is a prefetched weight broadcast or gather.
    prefetch: Vec<bool>,
}

fn graph(program: &Program, prefetch_weights: bool) -> Result<Graph<'_>> {
    let instrs: Vec<&Instr> =
        program.instructions.iter().filter(|instr| !matches!(instr, Instr::Free { .. } | Instr::Wait { .. })).collect();
    let mut deps = vec![Vec::new(); 2 * instrs.len()];
    let mut uses = vec![Vec::new(); 2 * instrs.len()];
    let mut available: HashMap<BufferId, Node> = HashMap::new();
    let (mut last_start, mut last_prefetch, mut last_output) = (None, None, None);
    let mut loaded: HashSet<BufferId> = HashSet::new();
    let mut prefetched = vec![false; instrs.len()];
    for (index, instr) in instrs.iter().enumerate() {
        let transfer = instr.is_transfer();
        if let Instr::LoadParam { out, .. } = instr {
            loaded.insert(*out);
        }
        let prefetch = prefetch_weights
            && matches!(instr, Instr::Broadcast { .. } | Instr::AllGather { .. })
            && instr.inputs().iter().all(|input| loaded.contains(input));
        prefetched[index] = prefetch;
        if prefetch {
            // Over dp × ep, ZeRO-3 gathers the ep gather of a weight over dp: a prefetch too.
            loaded.extend(instr.out());
        }
        // A transfer's operands are in use until its wait.
        let user = if transfer { wait_node(index) } else { run_node(index) };
        for buffer in instr.inputs() {
            if let Some(&node) = available.get(&buffer) {
                deps[run_node(index)].push(node);
            }
            uses[user].push(buffer);
        }
        if prefetch {
            deps[run_node(index)].extend(last_prefetch.map(run_node));
            deps[wait_node(index)].push(run_node(index));
            last_prefetch = Some(index);
        } else if transfer {
            // A prefetch lowered before this transfer stays before it.
            deps[run_node(index)].extend(last_start.into_iter().chain(last_prefetch).map(run_node));
            deps[wait_node(index)].push(run_node(index));
            last_start = Some(index);
        }
        if matches!(instr, Instr::Output { .. }) {
            deps[run_node(index)].extend(last_output.map(run_node));
            last_output = Some(index);
        }
        for buffer in instr.outs() {
            if available.insert(buffer, user).is_some() {
                return Err(Error::Inconsistent {
                    instr: index,
                    reason: format!("{buffer} is written twice; the overlap scheduler needs every buffer written once"),
                });
            }
            // A result nobody reads is freed once it exists.
            uses[user].push(buffer);
        }
    }
    let mut use_count = HashMap::new();
    for buffer in uses.iter().flatten() {
        *use_count.entry(*buffer).or_insert(0) += 1;
    }
    Ok(Graph { instrs, deps, uses, use_count, prefetch: prefetched })
}

/// Reorders `program` for overlap (see the module's documentation); returns the scheduled program,
/// in which every transfer is a start and a `Wait`, and what was done.
///
/// The budget is kept: the greedy choice can hold memory that a later instruction then needs, so a
/// schedule over the budget is made again with the budget lowered by the excess (three times at
/// most), and failing that the program is returned as lowered, every transfer blocking.
pub fn schedule(program: &Program, options: &OverlapOptions) -> Result<(Program, OverlapReport)> {
    let graph = graph(program, options.prefetch != Prefetch::Off)?;
    let peak_before_bytes = plan(program, options.sizing).peak_bytes;
    let largest_transfer = graph
        .instrs
        .iter()
        .filter(|instr| instr.is_transfer())
        .map(|instr| {
            instr.outs().into_iter().map(|out| element_bytes(program, out, options.sizing)).sum::<u64>()
                + staging_of(program, instr, options.sizing).map_or(0, |(_, size)| size)
        })
        .max()
        .unwrap_or(0);
    let budget_bytes = options.memory_budget.unwrap_or(peak_before_bytes + largest_transfer);
    let mut aim = budget_bytes;
    for _ in 0..4 {
        let (scheduled, mut report) = list_schedule(program, &graph, options, aim)?;
        report.peak_before_bytes = peak_before_bytes;
        report.budget_bytes = budget_bytes;
        if report.peak_after_bytes <= budget_bytes {
            return Ok((scheduled, report));
        }
        aim = aim.saturating_sub(report.peak_after_bytes - budget_bytes);
    }
    let seconds: f64 = graph
        .instrs
        .iter()
        .filter(|instr| !matches!(instr, Instr::Send { .. }))
        .map(|instr| (options.seconds)(program, instr).max(0.0))
        .sum();
    let report = OverlapReport {
        transfers: 0,
        overlapped: 0,
        budget_bytes,
        peak_before_bytes,
        peak_after_bytes: peak_before_bytes,
        blocking_s: seconds,
        scheduled_s: seconds,
    };
    Ok((program.clone(), report))
}

/// Schedules every rank's program (`programs`, in rank order) with `options`. With a
/// prefetch, when the ranks did not all move their prefetches alike (their transfers no
/// longer match), they are scheduled again without; the transfers of the result match.
pub fn schedule_ranks(programs: &[Program], options: &OverlapOptions) -> Result<Vec<(Program, OverlapReport)>> {
    let schedule_all = |options: &OverlapOptions| -> Result<Vec<(Program, OverlapReport)>> {
        let scheduled = programs.iter().map(|program| schedule(program, options)).collect::<Result<Vec<_>>>()?;
        let only_programs: Vec<Program> = scheduled.iter().map(|(program, _)| program.clone()).collect();
        crate::verify_collectives(&only_programs)?;
        Ok(scheduled)
    };
    match schedule_all(options) {
        Err(_) if options.prefetch != Prefetch::Off => {
            schedule_all(&OverlapOptions { prefetch: Prefetch::Off, ..*options })
        }
        result => result,
    }
}

/// One list schedule of `graph` aiming at `budget_bytes`.
fn list_schedule(
    program: &Program,
    graph: &Graph,
    options: &OverlapOptions,
    budget_bytes: u64,
) -> Result<(Program, OverlapReport)> {
    let count = graph.instrs.len();
    let bytes = |buffer: BufferId| element_bytes(program, buffer, options.sizing);
    let staging = |instr: &Instr| staging_of(program, instr, options.sizing).map_or(0, |(_, size)| size);
    let seconds: Vec<f64> = graph.instrs.iter().map(|instr| (options.seconds)(program, instr).max(0.0)).collect();
    let is_node = |node: Node| node % 2 == 0 || graph.instrs[node / 2].is_transfer();

    let mut successors = vec![Vec::new(); 2 * count];
    for (node, deps) in graph.deps.iter().enumerate() {
        for &dep in deps {
            successors[dep].push(node);
        }
    }

    let freed: HashSet<BufferId> = program
        .instructions
        .iter()
        .filter_map(|instr| match instr {
            Instr::Free { buf } => Some(*buf),
            _ => None,
        })
        .collect();
    // The lowered order's live bytes before and at each of its instructions: an instruction run
    // ahead of the lowered order (a transfer started early, compute run while a wait is pending)
    // holds its results beside everything the lowered order holds until the instruction's own
    // place in it.
    let (mut live_before, mut live_at) = (Vec::with_capacity(count), Vec::with_capacity(count));
    let mut lowered_live = 0u64;
    for instr in &program.instructions {
        match instr {
            Instr::Free { buf } => lowered_live = lowered_live.saturating_sub(bytes(*buf)),
            Instr::Wait { .. } => {}
            _ => {
                let results: u64 = instr.outs().into_iter().map(bytes).sum();
                live_before.push(lowered_live);
                live_at.push((lowered_live + staging(instr)).max(lowered_live + results));
                lowered_live += results;
            }
        }
    }
    let ahead_of = RangeMax::new(&live_at);
    let mut scheduled_run = vec![false; count];
    let mut progress = 0;
    let mut waiting_on: Vec<usize> = graph.deps.iter().map(Vec::len).collect();
    let mut candidates: Vec<Node> = (0..2 * count).filter(|&node| is_node(node) && waiting_on[node] == 0).collect();
    let mut done_at = vec![0.0f64; 2 * count];
    let mut transfer_end = vec![0.0f64; count];
    let mut remaining_uses = graph.use_count.clone();
    let own_stream = options.prefetch == Prefetch::OwnStream;
    // Per instruction: the stream its transfer runs on.
    let stream_of = |index: usize| {
        if own_stream && graph.prefetch[index] {
            TransferStream::Prefetch
        } else {
            TransferStream::Main
        }
    };
    let mut compute_free = 0.0f64;
    let mut streams = StreamClocks::default();
    let mut live = 0u64;
    let mut instructions = Vec::with_capacity(program.instructions.len() + count);
    while !candidates.is_empty() {
        let ready = |node: Node| {
            let deps = graph.deps[node].iter().map(|&dep| done_at[dep]).fold(0.0, f64::max);
            if node % 2 == 1 {
                deps.max(transfer_end[node / 2])
            } else if graph.prefetch[node / 2] {
                // A prefetch only fills an idle stream: on the main one, queued behind other
                // transfers it would delay them; on its own, one is in flight at a time (double
                // buffering) rather than every weight at once.
                deps.max(streams.free(stream_of(node / 2)))
            } else {
                deps
            }
        };
        let allocates = |node: Node| {
            let instr = graph.instrs[node / 2];
            if node % 2 == 1 {
                0
            } else {
                instr.outs().into_iter().map(bytes).sum::<u64>() + staging(instr)
            }
        };
        let fits = |node: Node| {
            let index = node / 2;
            if node % 2 == 0 && progress < index {
                let extra = live.saturating_sub(live_before[progress]);
                let ahead = ahead_of.max(progress..index);
                ahead + extra + allocates(node) <= budget_bytes
            } else {
                live + allocates(node) <= budget_bytes
            }
        };
        let is_start = |node: Node| node % 2 == 0 && graph.instrs[node / 2].is_transfer();
        // Starts first, then compute in the lowered order (which frees each activation soon
        // after it is made).
        let by_priority = |a: &&Node, b: &&Node| (!is_start(**b), **b).cmp(&(!is_start(**a), **a));
        let work: Vec<Node> =
            candidates.iter().copied().filter(|&node| node % 2 == 0 && ready(node) <= compute_free).collect();
        // A wait only when nothing else can run or fits: the one the earliest instruction of the
        // lowered order still to come needs, the earliest to end among equals. So each wait lands
        // right before its first reader, whatever the predicted seconds (waiting early on a
        // transfer the prediction thought fast would stall the compute stream), and when memory
        // is short a wait releases the transfer's staging and lets its operands be freed.
        let first_reader = |wait: Node| successors[wait].iter().map(|&next| next / 2).min().unwrap_or(usize::MAX);
        let wait = || {
            let waits = || candidates.iter().copied().filter(|&node| node % 2 == 1);
            let earliest_reader =
                |a: &Node, b: &Node| first_reader(*a).cmp(&first_reader(*b)).then(ready(*a).total_cmp(&ready(*b)));
            // A transfer predicted done costs no stall: waiting for it first lets its readers run
            // while the others are still in flight (TSP's next owner block, prefetched, before the
            // current owner's k/v all-gather). On the one stream it started before every transfer
            // not predicted done, so it ends before them whatever the prediction's error. Only
            // where it is all a reader still waits for, though: a prefetch for a later layer,
            // waited for now, would stall the compute stream if the prediction was short and let
            // nothing run sooner if it was not.
            let unblocks = |wait: Node| successors[wait].iter().any(|&next| waiting_on[next] == 1);
            waits()
                .filter(|&node| ready(node) <= compute_free && unblocks(node))
                .min_by(earliest_reader)
                .or_else(|| waits().min_by(earliest_reader))
        };
        let chosen = work
            .iter()
            .filter(|&&node| fits(node))
            .max_by(by_priority)
            .copied()
            .or_else(wait)
            // Over the budget regardless: the lowered order, which fits its own peak.
            .or_else(|| work.iter().min().copied())
            .unwrap_or_else(|| {
                // Nothing can run yet: the compute stream idles until the earliest candidate can.
                *candidates
                    .iter()
                    .min_by(|a, b| ready(**a).total_cmp(&ready(**b)).then(by_priority(b, a)))
                    .expect("candidates is not empty")
            });
        let start = compute_free.max(ready(chosen));
        let index = chosen / 2;
        let instr = graph.instrs[index];
        if chosen % 2 == 1 {
            compute_free = start;
            live = live.saturating_sub(staging(instr));
            instructions.push(Instr::Wait { handle: instr.transfer_handle().expect("a transfer") });
        } else if instr.is_transfer() {
            compute_free = start;
            let stream = stream_of(index);
            let begins = start.max(streams.free(stream));
            let (ends, stretched) = streams.run(stream, index, begins, seconds[index]);
            transfer_end[index] = ends;
            for (transfer, _, end) in stretched {
                transfer_end[transfer] = end;
            }
            live += allocates(chosen);
            instructions.push(instr.clone().on_stream(stream));
        } else {
            compute_free = start + seconds[index];
            live += allocates(chosen);
            instructions.push(instr.clone());
        }
        done_at[chosen] = compute_free;
        if chosen % 2 == 0 {
            scheduled_run[index] = true;
            while progress < count && scheduled_run[progress] {
                progress += 1;
            }
        }
        for &buffer in &graph.uses[chosen] {
            let left = remaining_uses.get_mut(&buffer).expect("every use is counted");
            *left -= 1;
            if *left == 0 && freed.contains(&buffer) {
                live = live.saturating_sub(bytes(buffer));
                instructions.push(Instr::Free { buf: buffer });
            }
        }
        candidates.retain(|&node| node != chosen);
        for &next in &successors[chosen] {
            waiting_on[next] -= 1;
            if waiting_on[next] == 0 {
                candidates.push(next);
            }
        }
    }
    let scheduled = Program { instructions, ..program.clone() };
    let pairs = crate::transfers::check_transfers(&scheduled)?;
    let overlapped = pairs
        .wait_of
        .iter()
        .filter(|&(&start, &wait)| {
            scheduled.instructions[start + 1..wait].iter().any(|between| !matches!(between, Instr::Free { .. }))
        })
        .count();
    let blocking_s = graph
        .instrs
        .iter()
        .zip(&seconds)
        .filter(|(instr, _)| !matches!(instr, Instr::Send { .. }))
        .map(|(_, seconds)| seconds)
        .sum();
    let report = OverlapReport {
        transfers: pairs.wait_of.len(),
        overlapped,
        budget_bytes,
        peak_before_bytes: 0,
        peak_after_bytes: plan(&scheduled, options.sizing).peak_bytes,
        blocking_s,
        scheduled_s: compute_free.max(streams.free(TransferStream::Main)).max(streams.free(TransferStream::Prefetch)),
    };
    Ok((scheduled, report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::program::{Buffer, BufferKind, Group, Kernel, TransferStream, FORMAT_VERSION};
    use pleat_ir::entity::EntityRef;
    use pleat_ir::DType;

    fn id(index: usize) -> BufferId {
        BufferId::new(index)
    }

    /// A Megatron block's tail on one rank: `y1 = x·w1` is all-reduced, `y2 = x·w2` does not need
    /// it, and `z = y1' + y2` needs both. Lowered blocking: matmul, all-reduce, matmul, add.
    fn block() -> Program {
        let buffer = |name: &str, kind| Buffer { name: name.into(), dtype: DType::F32, shape: vec![64, 64], kind };
        let matmul = |w: usize, out: usize| Instr::Kernel {
            kernel: Kernel::MatMul { m: 64, n: 64, k: 64 },
            inputs: vec![id(0), id(w)],
            out: id(out),
        };
        let load = |out: usize| Instr::LoadParam {
            out: id(out),
            name: format!("w{out}"),
            shape: vec![64, 64],
            region: vec![(0, 64), (0, 64)],
        };
        Program {
            format_version: FORMAT_VERSION,
            model: "hand".into(),
            mesh: "tp=2".into(),
            rank: 0,
            world_size: 2,
            tokens_shape: vec![],
            buffers: vec![
                buffer("x", BufferKind::Param),
                buffer("w1", BufferKind::Param),
                buffer("w2", BufferKind::Param),
                buffer("y1", BufferKind::Activation),
                buffer("y1.sum", BufferKind::Activation),
                buffer("y2", BufferKind::Activation),
                buffer("z", BufferKind::Activation),
            ],
            instructions: vec![
                load(0),
                load(1),
                load(2),
                matmul(1, 3),
                Instr::AllReduce {
                    inputs: vec![id(3)],
                    outs: vec![id(4)],
                    group: Group { axis: "tp".into(), ranks: vec![0, 1] },
                },
                Instr::Free { buf: id(3) },
                matmul(2, 5),
                Instr::Kernel { kernel: Kernel::Add, inputs: vec![id(4), id(5)], out: id(6) },
                Instr::Free { buf: id(4) },
                Instr::Free { buf: id(5) },
                Instr::Output { buf: id(6), index: 0, shape: vec![64, 64], region: vec![(0, 64), (0, 64)] },
            ],
        }
    }

    /// `out = a · w'`, 64×64 by 64×64.
    fn matmul(a: usize, w: usize, out: usize) -> Instr {
        Instr::Kernel { kernel: Kernel::MatMul { m: 64, n: 64, k: 64 }, inputs: vec![id(a), id(w)], out: id(out) }
    }

    /// A program of 64×64 f32 buffers named `names`, the first `params` of them parameters
    /// (loaded first, by these names), running `instructions` after the loads and writing buffer
    /// `output` as its output.
    fn program_of(names: &[&str], params: usize, instructions: Vec<Instr>, output: usize) -> Program {
        let buffer = |at: usize| Buffer {
            name: names[at].into(),
            dtype: DType::F32,
            shape: vec![64, 64],
            kind: if at < params { BufferKind::Param } else { BufferKind::Activation },
        };
        let loads = (0..params).map(|at| Instr::LoadParam {
            out: id(at),
            name: names[at].into(),
            shape: vec![64, 64],
            region: vec![(0, 64), (0, 64)],
        });
        let output = Instr::Output { buf: id(output), index: 0, shape: vec![64, 64], region: vec![(0, 64), (0, 64)] };
        Program {
            buffers: (0..names.len()).map(buffer).collect(),
            instructions: loads.chain(instructions).chain([output]).collect(),
            ..block()
        }
    }

    /// Seconds: a matmul 2, an all-reduce 1, anything else nothing.
    fn seconds(_: &Program, instr: &Instr) -> f64 {
        match instr {
            Instr::Kernel { kernel: Kernel::MatMul { .. }, .. } => 2.0,
            Instr::AllReduce { .. } => 1.0,
            _ => 0.0,
        }
    }

    fn text(program: &Program) -> Vec<String> {
        crate::text::print_program(program)
            .lines()
            .skip_while(|line| !line.contains("load_param"))
            .map(str::to_string)
            .collect()
    }

    #[test]
    fn a_transfer_slowed_by_the_other_stream_delays_the_next_one_on_its_stream() {
        let mut streams = StreamClocks::default();
        // Two transfers queued on the main stream, of two seconds each: [0, 2] and [2, 4].
        assert_eq!(streams.run(TransferStream::Main, 0, 0.0, 2.0).0, 2.0);
        assert_eq!(streams.run(TransferStream::Main, 1, 2.0, 2.0).0, 4.0);
        // A prefetch of 10 s from 1 s shares the link with both (3 s of their work left): each
        // runs at half speed beside it. The first's last second takes two: it ends at 3. The
        // second starts then, not at 2, and its two seconds take four: it ends at 7.
        let (ends, stretched) = streams.run(TransferStream::Prefetch, 2, 1.0, 10.0);
        assert_eq!(stretched, vec![(0, 0.0, 3.0), (1, 3.0, 7.0)]);
        assert_eq!(ends, 1.0 + 10.0 + 3.0);
        assert_eq!(streams.free(TransferStream::Main), 7.0);
    }

    #[test]
    fn the_all_reduce_runs_beside_the_independent_matmul_and_is_waited_for_by_its_reader() {
        let options = OverlapOptions {
            seconds: &seconds,
            memory_budget: None,
            sizing: ElementSize::Fixed(4),
            prefetch: Prefetch::Off,
        };
        let (scheduled, report) = schedule(&block(), &options).unwrap();
        assert_eq!(
            text(&scheduled),
            [
                "b0 = load_param \"w0\" [0..64, 0..64]",
                "b1 = load_param \"w1\" [0..64, 0..64]",
                "b2 = load_param \"w2\" [0..64, 0..64]",
                "b3 = matmul m=64 n=64 k=64(b0, b1)",
                "b4 = all_reduce(b3) tp[0, 1]",
                "b5 = matmul m=64 n=64 k=64(b0, b2)",
                "wait(b4)",
                "free b3",
                "b6 = add(b4, b5)",
                "free b4",
                "free b5",
                "output 0 = b6 [0..64, 0..64]",
            ]
        );
        assert_eq!((report.transfers, report.overlapped), (1, 1));
        // Blocking: 2 + 1 + 2; overlapped: the all-reduce hides behind the second matmul.
        assert_eq!((report.blocking_s, report.scheduled_s), (5.0, 4.0));
        // y1 stays until the wait, beside y2, where the lowered order had z: six 16 KiB buffers at
        // the peak either way.
        assert_eq!(report.peak_after_bytes, report.peak_before_bytes);
        assert_eq!(report.peak_after_bytes, 6 * 64 * 64 * 4);
    }

    #[test]
    fn a_transfer_already_done_is_waited_for_first_so_its_reader_hides_a_slower_one() {
        // y2 = x·w2 is all-reduced (fast) before y1 = x·w1 is (slow); the lowered order reads y1's
        // sum first. Both are in flight once the matmuls are done: waiting for y2's first lets its
        // matmul run while y1's all-reduce still travels.
        let buffer = |name: &str, kind| Buffer { name: name.into(), dtype: DType::F32, shape: vec![64, 64], kind };
        let matmul = |a: usize, w: usize, out: usize| Instr::Kernel {
            kernel: Kernel::MatMul { m: 64, n: 64, k: 64 },
            inputs: vec![id(a), id(w)],
            out: id(out),
        };
        let all_reduce = |input: usize, out: usize| Instr::AllReduce {
            inputs: vec![id(input)],
            outs: vec![id(out)],
            group: Group { axis: "tp".into(), ranks: vec![0, 1] },
        };
        let load = |out: usize| Instr::LoadParam {
            out: id(out),
            name: format!("w{out}"),
            shape: vec![64, 64],
            region: vec![(0, 64), (0, 64)],
        };
        let names = ["x", "w1", "w2", "w3", "y2", "y2.sum", "y1", "y1.sum", "z", "u"];
        let program = Program {
            buffers: names
                .iter()
                .enumerate()
                .map(|(at, name)| buffer(name, if at < 4 { BufferKind::Param } else { BufferKind::Activation }))
                .collect(),
            instructions: vec![
                load(0),
                load(1),
                load(2),
                load(3),
                matmul(0, 2, 4),
                all_reduce(4, 5),
                matmul(0, 1, 6),
                all_reduce(6, 7),
                Instr::Kernel { kernel: Kernel::Add, inputs: vec![id(7), id(0)], out: id(8) },
                matmul(5, 3, 9),
                Instr::Output { buf: id(8), index: 0, shape: vec![64, 64], region: vec![(0, 64), (0, 64)] },
                Instr::Output { buf: id(9), index: 1, shape: vec![64, 64], region: vec![(0, 64), (0, 64)] },
            ],
            ..block()
        };
        // A matmul 2 s, y2's all-reduce 1 s, y1's 4 s.
        let seconds = |_: &Program, instr: &Instr| match instr {
            Instr::Kernel { kernel: Kernel::MatMul { .. }, .. } => 2.0,
            Instr::AllReduce { inputs, .. } => {
                if inputs[0] == id(4) {
                    1.0
                } else {
                    4.0
                }
            }
            _ => 0.0,
        };
        let options = OverlapOptions {
            seconds: &seconds,
            memory_budget: None,
            sizing: ElementSize::Fixed(4),
            prefetch: Prefetch::Off,
        };
        let (scheduled, report) = schedule(&program, &options).unwrap();
        let text = text(&scheduled);
        let at = |line: &str| text.iter().position(|got| got == line).unwrap_or_else(|| panic!("{line} in {text:?}"));
        assert!(at("wait(b5)") < at("wait(b7)"), "{text:?}");
        assert!(at("b9 = matmul m=64 n=64 k=64(b5, b3)") < at("wait(b7)"), "{text:?}");
        // matmul 0-2, y2's all-reduce 2-3, matmul 2-4, y1's all-reduce 4-8; y2's reader 4-6; the
        // add after the wait at 8. Waiting for y1's first would stall 4-8 and end at 10.
        assert_eq!((report.blocking_s, report.scheduled_s), (11.0, 8.0));
    }

    /// `x` is all-reduced (3 s) and `w1` gathered (2 s, a weight: a prefetch) for `z = (x·w0)·w1'`,
    /// `u = z + x'`. On the one stream the gather waits for the all-reduce; on its own it starts at
    /// once and the two share the link: the gather ends at 4 (2 s at half speed, then none left
    /// to share), the all-reduce at 5.
    #[test]
    fn a_prefetch_on_its_own_stream_shares_the_link_instead_of_queueing() {
        let names = ["x", "w0", "w1", "x.sum", "y", "w1.gathered", "z", "u"];
        let tp = Group { axis: "tp".into(), ranks: vec![0, 1] };
        let program = program_of(
            &names,
            3,
            vec![
                Instr::AllReduce { inputs: vec![id(0)], outs: vec![id(3)], group: tp.clone() },
                matmul(0, 1, 4),
                Instr::AllGather { input: id(2), out: id(5), group: tp, dim: 0, stream: TransferStream::Main },
                matmul(4, 5, 6),
                Instr::Kernel { kernel: Kernel::Add, inputs: vec![id(6), id(3)], out: id(7) },
            ],
            7,
        );
        let seconds = |_: &Program, instr: &Instr| match instr {
            Instr::Kernel { kernel: Kernel::MatMul { .. }, .. } => 2.0,
            Instr::AllReduce { .. } => 3.0,
            Instr::AllGather { .. } => 2.0,
            _ => 0.0,
        };
        let scheduled = |prefetch| {
            let options =
                OverlapOptions { seconds: &seconds, memory_budget: None, sizing: ElementSize::Fixed(4), prefetch };
            let (program, report) = schedule(&program, &options).unwrap();
            (text(&program), report.scheduled_s)
        };
        // One stream: the all-reduce 0-3, the gather 3-5; y 0-2, z 5-7.
        let (one, one_s) = scheduled(Prefetch::MainStream);
        assert_eq!(one_s, 7.0, "{one:?}");
        assert!(one.iter().all(|line| !line.contains("on prefetch")), "{one:?}");
        // Two: both from 0, at half speed while both run; z 4-6, then the add.
        let (two, two_s) = scheduled(Prefetch::OwnStream);
        assert_eq!(two_s, 6.0, "{two:?}");
        let gather = two.iter().position(|line| line == "b5 = all_gather(b2) dim=0 tp[0, 1] on prefetch");
        let all_reduce = two.iter().position(|line| line == "b3 = all_reduce(b0) tp[0, 1]");
        assert!(gather.is_some() && all_reduce.is_some(), "{two:?}");
        assert!(gather < two.iter().position(|line| line.starts_with("b4 = matmul")), "{two:?}");
    }

    /// ZeRO-3 over dp × ep gathers a weight's shard over ep, then that over dp: both run on the
    /// prefetch stream ahead of the matmul that reads the whole weight.
    #[test]
    fn a_gather_of_a_prefetched_weight_gather_is_a_prefetch_too() {
        let names = ["x", "w", "w.ep", "w.whole", "y"];
        let group = |axis: &str| Group { axis: axis.into(), ranks: vec![0, 1] };
        let program = program_of(
            &names,
            2,
            vec![
                Instr::AllGather { input: id(1), out: id(2), group: group("ep"), dim: 0, stream: TransferStream::Main },
                Instr::AllGather { input: id(2), out: id(3), group: group("dp"), dim: 0, stream: TransferStream::Main },
                matmul(0, 3, 4),
            ],
            4,
        );
        let seconds = |_: &Program, instr: &Instr| if instr.is_transfer() { 1.0 } else { 2.0 };
        let options = OverlapOptions {
            seconds: &seconds,
            memory_budget: None,
            sizing: ElementSize::Fixed(4),
            prefetch: Prefetch::OwnStream,
        };
        let lines = text(&schedule(&program, &options).unwrap().0);
        for line in ["b2 = all_gather(b1) dim=0 ep[0, 1] on prefetch", "b3 = all_gather(b2) dim=0 dp[0, 1] on prefetch"]
        {
            assert!(lines.iter().any(|printed| printed == line), "{line} not in {lines:?}");
        }
    }

    /// `y = x·w0` is all-reduced (4 s) for `u = y' + x`; `w1`, a weight, is gathered on the
    /// prefetch stream (1 s) for `z = u·w1'`. Once `y` is made, the gather is predicted done and
    /// the all-reduce is not, but waiting for the gather first lets nothing run sooner (`z` needs
    /// `u` as well), and, were the gather slower than predicted, would stall the all-reduce's
    /// reader behind it: the all-reduce's wait comes first.
    #[test]
    fn a_prefetch_predicted_done_is_not_waited_for_before_its_reader_could_run() {
        let names = ["x", "w0", "w1", "y", "y.sum", "u", "w1.gathered", "z"];
        let tp = Group { axis: "tp".into(), ranks: vec![0, 1] };
        let program = program_of(
            &names,
            3,
            vec![
                matmul(0, 1, 3),
                Instr::AllReduce { inputs: vec![id(3)], outs: vec![id(4)], group: tp.clone() },
                Instr::Kernel { kernel: Kernel::Add, inputs: vec![id(4), id(0)], out: id(5) },
                Instr::AllGather { input: id(2), out: id(6), group: tp, dim: 0, stream: TransferStream::Main },
                matmul(5, 6, 7),
            ],
            7,
        );
        let seconds = |_: &Program, instr: &Instr| match instr {
            Instr::Kernel { kernel: Kernel::MatMul { .. }, .. } => 2.0,
            Instr::AllReduce { .. } => 4.0,
            Instr::AllGather { .. } => 1.0,
            _ => 0.0,
        };
        let options = OverlapOptions {
            seconds: &seconds,
            memory_budget: None,
            sizing: ElementSize::Fixed(4),
            prefetch: Prefetch::OwnStream,
        };
        let (scheduled, report) = schedule(&program, &options).unwrap();
        let text = text(&scheduled);
        let at = |line: &str| text.iter().position(|got| got == line).unwrap_or_else(|| panic!("{line} in {text:?}"));
        // The gather started first, on its own stream, and is waited for only once `u` exists.
        assert!(at("b6 = all_gather(b2) dim=0 tp[0, 1] on prefetch") < at("b3 = matmul m=64 n=64 k=64(b0, b1)"));
        assert!(at("wait(b4)") < at("b5 = add(b4, b0)"), "{text:?}");
        assert!(at("b5 = add(b4, b0)") < at("wait(b6)"), "{text:?}");
        // y 0-2, its all-reduce 2-6, u at 6, z 6-8 (the gather was done at 1).
        assert_eq!(report.scheduled_s, 8.0);
    }

    #[test]
    fn a_budget_no_schedule_keeps_to_leaves_the_program_as_lowered() {
        let options = OverlapOptions {
            seconds: &seconds,
            memory_budget: Some(0),
            sizing: ElementSize::Fixed(4),
            prefetch: Prefetch::Off,
        };
        let (scheduled, report) = schedule(&block(), &options).unwrap();
        assert_eq!(scheduled, block());
        assert_eq!((report.transfers, report.scheduled_s, report.blocking_s), (0, 5.0, 5.0));
    }

    #[test]
    fn a_buffer_written_twice_is_refused() {
        let mut program = block();
        program.instructions.push(Instr::Kernel { kernel: Kernel::Add, inputs: vec![id(0), id(0)], out: id(6) });
        let err = schedule(
            &program,
            &OverlapOptions {
                seconds: &seconds,
                memory_budget: None,
                sizing: ElementSize::Fixed(4),
                prefetch: Prefetch::Off,
            },
        )
        .unwrap_err();
        assert!(err.to_string().contains("b6 is written twice"), "{err}");
    }
}
