//! Training on threads: every rank runs its forward-and-backward program once a step, then updates
//! the parameter elements its `OptimizerLayout` gives it with AdamW, and shares them again. The
//! program runs on the CPU executor here, or on a GPU (`crate::cuda::train_on_device`, through the
//! same `train_rank`); the optimizer always runs here.
//!
//! Each rank keeps its parameter blocks resident between steps (the program reads them through
//! `ResidentWeights`) and the two AdamW moments of the elements it updates; it holds no other rank's
//! state. The optimizer is written here, apart from the reference (`pleat_ir::optim`), and follows
//! the same `torch.optim.AdamW` arithmetic: f64 per element, moments rounded to f32. Gradient
//! clipping uses the global L2 norm over every parameter element counted once (the lowest of the
//! ranks holding the same elements counts them), summed by an all-reduce over every rank. With
//! ZeRO-1 and 2 a rank updates only its `dp` share of rows and the group all-gathers them back into
//! every member's block; with ZeRO-3 the block is the share.
//!
//! The memory a step reports is the executor's measured peak (the program's parameters,
//! activations, gradients) plus the optimizer's state: the moments, 8 bytes an updated element,
//! and, when the program's parameters are bf16 (mixed precision), the f32 master weights of those
//! elements, 4 bytes each (Megatron's 4 + 8 of optimizer state a parameter, split over `dp` by
//! ZeRO like the moments: the distributed optimizer's 12/dp). The resident blocks stage the
//! program's weights between steps: the program reads them rounded to bf16, its bf16 gradients
//! update the rank's own elements in f32, and the updated rows travel back into every member's
//! blocks. Only the elements a rank updates need f32 precision between steps, so only they are
//! counted as master weights; the rest are the program's weights and are not counted twice, as
//! with f32 parameters.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use pleat_backend::optimizer::{OptimizerLayout, ParamUpdate};
use pleat_backend::{Instr, Program};

use crate::comm::{CommStats, Communicator, Group, LinkSpec, ThreadFabric};
use crate::error::{Error, Result};
use crate::executor::{execute_native, OutputBlock, RankOutcome, RunInputs};
use crate::native::NativeKernels;
use crate::weights::{BlockWeights, WeightError, WeightSource};

/// AdamW's settings (torch's names and defaults but the learning rate).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AdamWSettings {
    /// Learning rate.
    pub learning_rate: f64,
    /// First-moment decay.
    pub beta1: f64,
    /// Second-moment decay.
    pub beta2: f64,
    /// Added to the denominator.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Clip the gradients to this global L2 norm first.
    pub max_grad_norm: Option<f64>,
}

impl From<&pleat_ir::optim::AdamWConfig> for AdamWSettings {
    /// The reference optimizer's configuration, field for field.
    fn from(config: &pleat_ir::optim::AdamWConfig) -> AdamWSettings {
        AdamWSettings {
            learning_rate: config.learning_rate,
            beta1: config.beta1,
            beta2: config.beta2,
            eps: config.eps,
            weight_decay: config.weight_decay,
            max_grad_norm: config.max_grad_norm,
        }
    }
}

/// What to train for.
pub struct TrainOptions<'a> {
    /// Steps to take.
    pub steps: u32,
    /// The optimizer.
    pub adamw: AdamWSettings,
    /// Every step's global token ids, `[batch, seq]` row-major.
    pub batches: &'a (dyn Fn(u32) -> Vec<u32> + Sync),
    /// The positions, `[seq]`.
    pub positions: &'a [u32],
    /// The parameters before the first step.
    pub initial: &'a dyn WeightSource,
    /// The optimizer's moments before the first step (`<name>.exp_avg` and `<name>.exp_avg_sq`, in
    /// the parameter's shape); `None` starts them at zero.
    pub moments: Option<&'a dyn WeightSource>,
    /// Steps already taken (a resumed run): the first step here is step `start_step + 1` of Adam's
    /// bias correction and reads the batch of step `start_step`.
    pub start_step: u32,
    /// How long any collective wait may take.
    pub timeout: Duration,
    /// The link every message is delivered over (`--emulate-link`); `None`: memory speed.
    pub link: Option<LinkSpec>,
    /// Rank `i`'s native code at index `i`, generated for its program: a rank whose library has an
    /// entry function runs every step through it (`crate::capi`); empty: every rank interprets.
    /// (Training on a device does not read it.)
    pub native: &'a [Option<NativeKernels>],
    /// Called by rank 0 as it finishes each step, with the step's number (1-based, counting the
    /// steps of a resumed run): what a progress display reads.
    pub on_step: Option<&'a (dyn Fn(u32) + Sync)>,
}

/// What one rank's training produced.
#[derive(Clone, Debug)]
pub struct RankTraining {
    /// The rank.
    pub rank: u32,
    /// The loss of each step (the whole batch's mean); empty on a rank whose program does not
    /// compute it (a pipeline stage before the last).
    pub losses: Vec<f32>,
    /// The global gradient norm of each step, before clipping.
    pub grad_norms: Vec<f64>,
    /// The first step's output blocks: the loss, then the gradients.
    pub first_outputs: Vec<OutputBlock>,
    /// What the first step's program (forward and backward, not the optimizer) sent.
    pub first_comm: CommStats,
    /// The rank's parameter blocks after the last step (`index`: the parameter's position in the
    /// program's loads), with their names.
    pub params: Vec<(String, OutputBlock)>,
    /// The most bytes a step held: the executor's peak plus the optimizer's moments.
    pub peak_bytes: u64,
    /// The optimizer's moments, in bytes.
    pub optimizer_bytes: u64,
    /// The most bytes a step held in activation buffers (intermediate values, gradients included).
    pub activation_peak_bytes: u64,
    /// The planned arena a step's buffers lived in, where native code ran it
    /// (`RankOutcome::arena_bytes`); 0 otherwise.
    pub arena_bytes: u64,
    /// The share of the first step's program time spent waiting in point-to-point receives: a
    /// pipeline stage's measured bubble (collectives' waits are not counted).
    pub first_recv_wait_share: f64,
    /// The first step's instruction timings (`RankOutcome::timings`), for its trace.
    pub first_timings: Vec<(u64, u64)>,
    /// The last step's instruction timings: on a GPU warm, where the first step's include each
    /// kernel's first launch (cuBLAS and the driver load their kernels lazily).
    pub last_timings: Vec<(u64, u64)>,
    /// After the last step, each parameter's name and the rank's blocks of its two moments (the
    /// elements it updates), in the parameter's global shape.
    pub moments: Vec<(String, OutputBlock, OutputBlock)>,
}

/// The state of a run after its last step, as blocks that any mesh can read back: the parameters,
/// and the AdamW moments as `<name>.exp_avg` and `<name>.exp_avg_sq` in the parameter's shape. A
/// block several ranks hold (a replica under dp without ZeRO) is kept once, the lowest rank's.
pub fn final_state(ranks: &[RankTraining]) -> Result<(BlockWeights, BlockWeights)> {
    let mut order: Vec<&RankTraining> = ranks.iter().collect();
    order.sort_by_key(|training| training.rank);
    let mut params = BlockWeights::new("the training state");
    let mut moments = BlockWeights::new("the training state's moments");
    for training in order {
        let weight_error = |source| Error::Weight { rank: training.rank, source: Box::new(source) };
        for (name, block) in &training.params {
            params.insert(name, &block.shape, &block.region, block.data.clone()).map_err(weight_error)?;
        }
        for (name, exp_avg, exp_avg_sq) in &training.moments {
            for (suffix, block) in [("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)] {
                if block.data.is_empty() {
                    continue;
                }
                let name = format!("{name}.{suffix}");
                moments.insert(&name, &block.shape, &block.region, block.data.clone()).map_err(weight_error)?;
            }
        }
    }
    Ok((params, moments))
}

/// A parameter block a rank keeps between steps.
struct Resident {
    name: String,
    shape: Vec<u64>,
    region: Vec<(u64, u64)>,
    data: Vec<f32>,
}

/// The rank's resident parameters as a weight source: a read must ask for exactly a held block.
struct ResidentWeights<'a>(&'a [Resident]);

impl WeightSource for ResidentWeights<'_> {
    fn read(&self, name: &str, shape: &[u64], region: &[(u64, u64)]) -> std::result::Result<Vec<f32>, WeightError> {
        self.0
            .iter()
            .find(|block| block.name == name && block.shape == shape && block.region == region)
            .map(|block| block.data.clone())
            .ok_or_else(|| WeightError::NotResident { name: name.to_string(), region: region.to_vec() })
    }
}

/// Runs one step's forward-and-backward program for a rank and returns what it measured and output
/// (the loss, then the gradients): the CPU executor's, or a device's.
pub(crate) type StepRunner<'r> = dyn FnMut(&Program, &mut dyn Communicator, &RunInputs) -> Result<RankOutcome> + 'r;

/// Trains `programs` (one a rank, each with its optimizer layout) on threads.
pub fn train_on_threads(
    programs: &[Program],
    layouts: &[OptimizerLayout],
    options: &TrainOptions,
) -> Result<Vec<RankTraining>> {
    check_layouts(programs, layouts)?;
    crate::launch::check_thread_ranks(programs.len() as u64)?;
    let world_size = programs.len() as u32;
    let comms = ThreadFabric::with_link(world_size, options.timeout, options.link);
    crate::launch::on_threads(comms, |rank, comm| {
        let native = options.native.get(rank as usize).and_then(Option::as_ref);
        train_rank(&programs[rank as usize], &layouts[rank as usize], comm, options, &mut |program, comm, inputs| {
            execute_native(program, comm, inputs, 1, native)
        })
    })
}

/// Refuses a world whose optimizer layouts are not one a program.
pub(crate) fn check_layouts(programs: &[Program], layouts: &[OptimizerLayout]) -> Result<()> {
    if layouts.len() != programs.len() {
        return Err(Error::Inputs {
            reason: format!("{} programs but {} optimizer layouts; give one a rank", programs.len(), layouts.len()),
        });
    }
    Ok(())
}

/// Trains one rank: `options.steps` steps, each running `program` through `run_step` and then the
/// optimizer over `layout` on the host.
pub(crate) fn train_rank(
    program: &Program,
    layout: &OptimizerLayout,
    comm: &mut dyn Communicator,
    options: &TrainOptions,
    run_step: &mut StepRunner,
) -> Result<RankTraining> {
    let rank = program.rank;
    let mut resident = Vec::new();
    for instr in &program.instructions {
        if let Instr::LoadParam { name, shape, region, .. } = instr {
            let data = options
                .initial
                .read(name, shape, region)
                .map_err(|source| Error::Weight { rank, source: Box::new(source) })?;
            resident.push(Resident { name: name.clone(), shape: shape.clone(), region: region.clone(), data });
        }
    }
    let mut moments = Vec::with_capacity(layout.params.len());
    for param in &layout.params {
        let zeros = || vec![0.0; param.update.1 as usize];
        let Some(source) = options.moments else {
            moments.push((zeros(), zeros()));
            continue;
        };
        let (shape, region) = update_region(param, &resident)?;
        let read = |suffix: &str| {
            source
                .read(&format!("{}.{suffix}", param.name), &shape, &region)
                .map_err(|source| Error::Weight { rank, source: Box::new(source) })
        };
        moments.push((read("exp_avg")?, read("exp_avg_sq")?));
    }
    let master_bytes = if program_params_are_bf16(program) { 4 * layout.updated_elements() } else { 0 };
    let optimizer_bytes = 8 * layout.updated_elements() + master_bytes;
    let world = Group::new(layout.world.ranks.clone());
    let mut losses = Vec::new();
    let mut grad_norms = Vec::new();
    let mut first_outputs = Vec::new();
    let mut first_comm = CommStats::default();
    let mut peak_bytes = 0;
    let mut activation_peak_bytes = 0;
    let mut arena_bytes = 0;
    let mut first_recv_wait_share = 0.0;
    let mut first_timings = Vec::new();
    let mut last_timings = Vec::new();
    let epoch = Instant::now();
    for step in options.start_step..options.start_step + options.steps {
        let tokens = (options.batches)(step);
        let inputs =
            RunInputs { tokens: &tokens, positions: options.positions, weights: &ResidentWeights(&resident), epoch };
        let outcome = run_step(program, comm, &inputs)?;
        peak_bytes = peak_bytes.max(outcome.peak_bytes + optimizer_bytes);
        activation_peak_bytes = activation_peak_bytes.max(outcome.activation_bytes.iter().copied().max().unwrap_or(0));
        arena_bytes = arena_bytes.max(outcome.arena_bytes);
        // A pipeline's earlier stages have no loss.
        let loss = outcome.outputs.iter().find(|block| block.index == 0).and_then(|block| block.data.first());
        losses.extend(loss.copied());
        let grads: HashMap<u32, &OutputBlock> = outcome.outputs.iter().map(|block| (block.index, block)).collect();
        let optimizer = Step { rank, step: step + 1, settings: options.adamw };
        grad_norms.push(optimizer.apply(layout, &grads, &mut resident, &mut moments, comm, &world)?);
        if let (0, Some(on_step)) = (rank, options.on_step) {
            on_step(step + 1);
        }
        if step == options.start_step {
            first_recv_wait_share = recv_wait_share(program, &outcome.timings);
            first_timings.clone_from(&outcome.timings);
            first_outputs = outcome.outputs;
            first_comm = outcome.comm;
        }
        last_timings = outcome.timings;
    }
    let mut moment_blocks = Vec::with_capacity(layout.params.len());
    for (param, (exp_avg, exp_avg_sq)) in layout.params.iter().zip(moments) {
        let (shape, region) = update_region(param, &resident)?;
        let block = |data| OutputBlock { index: 0, shape: shape.clone(), region: region.clone(), data };
        moment_blocks.push((param.name.clone(), block(exp_avg), block(exp_avg_sq)));
    }
    let params = resident
        .into_iter()
        .enumerate()
        .map(|(index, block)| {
            let output =
                OutputBlock { index: index as u32, shape: block.shape, region: block.region, data: block.data };
            (block.name, output)
        })
        .collect();
    Ok(RankTraining {
        rank,
        losses,
        grad_norms,
        first_outputs,
        first_comm,
        params,
        peak_bytes,
        optimizer_bytes,
        activation_peak_bytes,
        arena_bytes,
        first_recv_wait_share,
        first_timings,
        last_timings,
        moments: moment_blocks,
    })
}

/// Whether the program's parameters are bf16, so that the resident f32 blocks are master weights
/// held beside it.
fn program_params_are_bf16(program: &Program) -> bool {
    program
        .buffers
        .iter()
        .any(|buffer| buffer.kind == pleat_backend::BufferKind::Param && buffer.dtype == pleat_backend::DType::Bf16)
}

/// The share of a run's time (first instruction's start to last's end) its receives took.
fn recv_wait_share(program: &Program, timings: &[(u64, u64)]) -> f64 {
    let (Some(first), Some(last)) = (timings.first(), timings.last()) else { return 0.0 };
    let total = last.1.saturating_sub(first.0);
    let waiting: u64 = program
        .instructions
        .iter()
        .zip(timings)
        .filter(|(instr, _)| matches!(instr, Instr::Recv { .. } | Instr::Relay { .. }))
        .map(|(_, &(start, end))| end.saturating_sub(start))
        .sum();
    if total == 0 {
        0.0
    } else {
        waiting as f64 / total as f64
    }
}

/// A tensor's global shape and a block of it, per dim `(start, len)`.
type ShapeAndRegion = (Vec<u64>, Vec<(u64, u64)>);

/// The global shape and region of the elements `param` updates: its resident block narrowed to
/// the update range, a contiguous run of the row-major block (whole rows, or under ZeRO a run
/// inside one row once a rank's share is less than one).
fn update_region(param: &ParamUpdate, resident: &[Resident]) -> Result<ShapeAndRegion> {
    let block = resident.iter().find(|block| block.name == param.name).ok_or_else(|| Error::Inputs {
        reason: format!("the optimizer updates {}, which the program never loads", param.name),
    })?;
    let region = run_region(&block.region, param.update).ok_or_else(|| Error::Inputs {
        reason: format!(
            "the update range {}+{} of {} is not a box of its block {:?}",
            param.update.0, param.update.1, param.name, block.region
        ),
    })?;
    Ok((block.shape.clone(), region))
}

/// The box of the global tensor that the run `(offset, len)` of the row-major block `block`
/// (per dim, `(start, len)`) covers: one index in each dim before some dim `d`, a range of `d`,
/// and every dim after it whole; `None` when the run is no such box.
fn run_region(block: &[(u64, u64)], (offset, len): (u64, u64)) -> Option<Vec<(u64, u64)>> {
    // A scalar's one element is its whole block.
    if block.is_empty() {
        return (offset == 0 && len == 1).then(Vec::new);
    }
    let lens: Vec<u64> = block.iter().map(|&(_, len)| len).collect();
    // The elements one index of each dim spans.
    let strides: Vec<u64> = (0..lens.len()).map(|dim| lens[dim + 1..].iter().product()).collect();
    let dim = (0..lens.len()).find(|&dim| {
        let stride = strides[dim].max(1);
        len % stride == 0 && offset % stride == 0 && (offset / stride) % lens[dim] + len / stride <= lens[dim]
    })?;
    Some(
        block
            .iter()
            .enumerate()
            .map(|(index, &(start, whole))| match index.cmp(&dim) {
                std::cmp::Ordering::Less => (start + (offset / strides[index]) % whole, 1),
                std::cmp::Ordering::Equal => {
                    (start + (offset / strides[index].max(1)) % whole, len / strides[index].max(1))
                }
                std::cmp::Ordering::Greater => (start, whole),
            })
            .collect(),
    )
}

/// One optimizer step of one rank.
struct Step {
    rank: u32,
    step: u32,
    settings: AdamWSettings,
}

impl Step {
    fn error(&self, reason: String) -> Error {
        Error::Inputs { reason: format!("rank {}: optimizer step {}: {reason}", self.rank, self.step) }
    }

    /// The gradient elements `param` updates with.
    fn grad_range<'g>(&self, param: &ParamUpdate, grads: &HashMap<u32, &'g OutputBlock>) -> Result<&'g [f32]> {
        let block = grads
            .get(&param.grad_output)
            .ok_or_else(|| self.error(format!("no gradient output {} for {}", param.grad_output, param.name)))?;
        let (start, len) = (param.update.0 as usize, param.update.1 as usize);
        let range = if param.grad_is_slice { Some(&block.data[..]) } else { block.data.get(start..start + len) };
        match range {
            Some(range) if range.len() == len => Ok(range),
            _ => Err(self.error(format!(
                "the gradient of {} has {} elements, which do not hold its update range {start}+{len}",
                param.name,
                block.data.len()
            ))),
        }
    }

    fn apply(
        &self,
        layout: &OptimizerLayout,
        grads: &HashMap<u32, &OutputBlock>,
        resident: &mut [Resident],
        moments: &mut [(Vec<f32>, Vec<f32>)],
        comm: &mut dyn Communicator,
        world: &Group,
    ) -> Result<f64> {
        let comm_error = |source| Error::Comm {
            rank: self.rank,
            instr: usize::MAX,
            what: "optimizer".into(),
            source: Box::new(source),
        };
        let mut square_sum = 0.0_f64;
        for param in layout.params.iter().filter(|param| param.counts_in_norm) {
            square_sum += self.grad_range(param, grads)?.iter().map(|&g| f64::from(g) * f64::from(g)).sum::<f64>();
        }
        let mut total = [square_sum as f32];
        comm.all_reduce(world, &mut total).map_err(comm_error)?;
        let norm = f64::from(total[0]).sqrt();
        if !norm.is_finite() {
            return Err(Error::Diverged { rank: self.rank, step: self.step, norm });
        }
        let AdamWSettings { learning_rate, beta1, beta2, eps, weight_decay, max_grad_norm } = self.settings;
        let clip_scale = max_grad_norm.map_or(1.0, |max_norm| (max_norm / (norm + 1e-6)).min(1.0));
        let exponent = i32::try_from(self.step).unwrap_or(i32::MAX);
        let step_size = learning_rate / (1.0 - beta1.powi(exponent));
        let bias_correction2_sqrt = (1.0 - beta2.powi(exponent)).sqrt();
        for (param, (exp_avg, exp_avg_sq)) in layout.params.iter().zip(moments.iter_mut()) {
            let grad = self.grad_range(param, grads)?;
            let block = resident
                .iter_mut()
                .find(|block| block.name == param.name)
                .ok_or_else(|| self.error(format!("no resident block of {}", param.name)))?;
            let (start, len) = (param.update.0 as usize, param.update.1 as usize);
            let weights = &mut block.data[start..start + len];
            for index in 0..len {
                let g = f64::from(grad[index]) * clip_scale;
                let m = beta1 * f64::from(exp_avg[index]) + (1.0 - beta1) * g;
                let v = beta2 * f64::from(exp_avg_sq[index]) + (1.0 - beta2) * g * g;
                exp_avg[index] = m as f32;
                exp_avg_sq[index] = v as f32;
                let decayed = f64::from(weights[index]) * (1.0 - learning_rate * weight_decay);
                let denominator = f64::from(v as f32).sqrt() / bias_correction2_sqrt + eps;
                weights[index] = (decayed - step_size * f64::from(m as f32) / denominator) as f32;
            }
            if let Some(group) = &param.gather {
                let mine = block.data[start..start + len].to_vec();
                let group = Group::new(group.ranks.clone());
                comm.all_gather(&group, &mine, &mut block.data).map_err(comm_error)?;
            }
        }
        Ok(norm)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_backend::Group as ProgramGroup;

    #[test]
    fn an_update_run_is_a_box_of_the_block() {
        // A rank's block of k (heads 2..4 of a tensor, head_dim 16, hidden 128).
        let block = [(2, 2), (0, 16), (0, 128)];
        assert_eq!(run_region(&block, (16 * 128, 16 * 128)), Some(vec![(3, 1), (0, 16), (0, 128)]));
        assert_eq!(run_region(&block, (0, 2 * 16 * 128)), Some(block.to_vec()));
        // A run inside the first head: half its head_dim.
        assert_eq!(run_region(&block, (8 * 128, 8 * 128)), Some(vec![(2, 1), (8, 8), (0, 128)]));
        // Across the two heads it is no box.
        assert_eq!(run_region(&block, (8 * 128, 16 * 128)), None);
        // A scalar's block is its one element.
        assert_eq!(run_region(&[], (0, 1)), Some(Vec::new()));
    }

    fn settings(max_grad_norm: Option<f64>) -> AdamWSettings {
        AdamWSettings { learning_rate: 0.1, beta1: 0.9, beta2: 0.999, eps: 1e-8, weight_decay: 0.01, max_grad_norm }
    }

    /// Two ranks each update one of the two elements of `w` (ZeRO-2's layout: the gradient block
    /// is the update range) and all-gather them; returns each rank's block, the norm and the first
    /// moment of its element.
    fn two_rank_step(grads: [f32; 2], max_grad_norm: Option<f64>) -> Vec<(Vec<f32>, f64, f32)> {
        let comms = ThreadFabric::new(2, Duration::from_secs(10));
        std::thread::scope(|scope| {
            let handles: Vec<_> = comms
                .into_iter()
                .enumerate()
                .map(|(rank, mut comm)| {
                    scope.spawn(move || {
                        let ranks = vec![0, 1];
                        let layout = OptimizerLayout {
                            params: vec![ParamUpdate {
                                name: "w".into(),
                                grad_output: 1,
                                update: (rank as u64, 1),
                                grad_is_slice: true,
                                counts_in_norm: true,
                                gather: Some(ProgramGroup { axis: "dp".into(), ranks: ranks.clone() }),
                            }],
                            world: ProgramGroup { axis: "world".into(), ranks },
                        };
                        let grad = OutputBlock {
                            index: 1,
                            shape: vec![2],
                            region: vec![(rank as u64, 1)],
                            data: vec![grads[rank]],
                        };
                        let grads = HashMap::from([(1, &grad)]);
                        let mut resident = vec![Resident {
                            name: "w".into(),
                            shape: vec![2],
                            region: vec![(0, 2)],
                            data: vec![1.0, 1.0],
                        }];
                        let mut moments = vec![(vec![0.0], vec![0.0])];
                        let step = Step { rank: rank as u32, step: 1, settings: settings(max_grad_norm) };
                        let world = Group::new(vec![0, 1]);
                        let norm = step.apply(&layout, &grads, &mut resident, &mut moments, &mut comm, &world).unwrap();
                        (resident.remove(0).data, norm, moments[0].0[0])
                    })
                })
                .collect();
            handles.into_iter().map(|handle| handle.join().unwrap()).collect()
        })
    }

    #[test]
    fn each_rank_updates_its_share_and_the_group_gathers_it() {
        // By hand (lr 0.1, betas 0.9/0.999, eps 1e-8, weight decay 0.01, w = 1): the first step
        // decays w to 0.999 and moves it by lr·sign(g) (Adam's first step is m/sqrt(v) = g/|g|,
        // up to eps): g = 0.5 gives 0.899, g = -0.25 gives 1.099.
        for (rank, (block, norm, moment)) in two_rank_step([0.5, -0.25], None).into_iter().enumerate() {
            assert!((block[0] - 0.899).abs() < 1e-6 && (block[1] - 1.099).abs() < 1e-6, "{block:?}");
            assert!((moment - [0.05, -0.025][rank]).abs() < 1e-8, "{moment}");
            // The norm counts each rank's element once: sqrt(0.25 + 0.0625).
            assert!((norm - 0.3125_f64.sqrt()).abs() < 1e-7, "{norm}");
        }
    }

    #[test]
    fn clipping_scales_by_the_global_norm() {
        // With g = (0.5, 0) and a max norm of 0.25 the clipped gradient is (0.25, 0) (scale
        // 0.25 / (0.5 + 1e-6)): the first moments are 0.1·0.25 and 0. Adam's first step still moves
        // the first element by lr (sign only) and leaves the second (g = 0) at its decayed value,
        // 0.999; the reported norm is the unclipped 0.5.
        for (rank, (block, norm, moment)) in two_rank_step([0.5, 0.0], Some(0.25)).into_iter().enumerate() {
            assert!((block[0] - 0.899).abs() < 1e-6 && (block[1] - 0.999).abs() < 1e-6, "{block:?}");
            assert!((moment - [0.025, 0.0][rank]).abs() < 1e-7, "{moment}");
            assert!((norm - 0.5).abs() < 1e-7, "{norm}");
        }
    }
}
