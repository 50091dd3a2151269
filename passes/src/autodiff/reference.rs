//! The single-device reference training run: the oracle sharded training is checked against.
//!
//! Each step runs the unsharded training graph and its backward graph (`differentiate`) in the
//! reference interpreter and then the reference AdamW (`pleat_ir::optim`). Nothing here is shared
//! with the runtime's training loop or kernels.

use std::collections::HashMap;

use pleat_ir::interp::{routing_margin, run_all_as_stored, run_as_stored, Inputs, ParamLookup};
use pleat_ir::model::config::ModelConfig;
use pleat_ir::optim::{AdamW, AdamWConfig};
use pleat_ir::{Op, ValueId};

use super::differentiate;

/// What the reference run produced.
#[derive(Clone, Debug, PartialEq)]
pub struct ReferenceTraining {
    /// The loss of each step.
    pub losses: Vec<f32>,
    /// Each parameter's gradient at the first step, by checkpoint name.
    pub first_grads: HashMap<String, Vec<f32>>,
    /// Each parameter after the last step, by checkpoint name.
    pub weights: HashMap<String, Vec<f32>>,
    /// Each parameter's shape, by checkpoint name.
    pub shapes: HashMap<String, Vec<u64>>,
    /// For each step, how near the top-k routing of the mixture-of-experts layers came to choosing
    /// differently (`pleat_ir::interp::routing_margin`, the smallest over the layers and
    /// micro-batches); infinite without experts.
    pub routing_margins: Vec<f64>,
}

/// Why the reference could not train.
#[derive(Clone, Debug, PartialEq, thiserror::Error, miette::Diagnostic)]
#[error("reference training, step {step}: {reason}")]
#[diagnostic(code(E0415), help("check the model, batch and tokens of the reference run"))]
pub struct ReferenceError {
    /// The step that failed (0 while building).
    pub step: u32,
    /// What went wrong.
    pub reason: String,
}

/// Where a reference run starts: the parameters, and for a resumed run the steps already taken and
/// the optimizer's moments (`<name>.exp_avg`, `<name>.exp_avg_sq`).
pub struct ReferenceStart<'a> {
    /// Each parameter's starting value, by name and shape.
    pub weights: &'a ParamLookup<'a>,
    /// Steps already taken: the first step here reads the batch of this step and is this step
    /// plus one for Adam's bias correction.
    pub step: u32,
    /// The moments; `None` starts them at zero.
    pub moments: Option<&'a ParamLookup<'a>>,
}

/// Trains `config` for `steps` steps of `batch` sequences of `seq` tokens from `start`;
/// `batches` gives each step's tokens. With `micro_batches` above 1 each step runs the graph of
/// `batch / micro_batches` sequences on consecutive slices of its tokens and takes the mean of
/// their losses and gradients (gradient accumulation): for the cross-entropy that is the whole
/// batch's, and the load-balancing loss becomes each micro-batch's own, as in Hugging Face and
/// Megatron under gradient accumulation. The graphs run at `config`'s dtype as the runtime stores
/// it (`pleat_ir::interp::run_as_stored`: under bf16 every bf16 value rounded as it is computed);
/// the optimizer keeps f32 master weights and moments.
pub fn train_reference(
    config: &ModelConfig,
    (batch, seq): (u64, u64),
    micro_batches: u64,
    steps: u32,
    adamw: AdamWConfig,
    start: &ReferenceStart,
    batches: &dyn Fn(u32) -> Vec<u32>,
) -> Result<ReferenceTraining, ReferenceError> {
    let error = |step: u32| move |reason: String| ReferenceError { step, reason };
    if micro_batches == 0 || batch % micro_batches != 0 {
        return Err(error(0)(format!("{batch} sequences do not split into {micro_batches} micro-batches")));
    }
    let rows = batch / micro_batches;
    let mut module = pleat_ir::model::build_training(config, rows, seq).map_err(|err| error(0)(err.to_string()))?;
    let loss = module.graph.outputs()[0];
    let gradients = differentiate(&mut module.graph, loss).map_err(|err| error(0)(err.to_string()))?;
    let names: Vec<String> = gradients.params.iter().map(|param| param.name.clone()).collect();
    let shapes: HashMap<String, Vec<u64>> = gradients
        .params
        .iter()
        .map(|param| (param.name.clone(), module.graph.value(param.params[0]).ty.shape.sizes()))
        .collect();
    let mut starting = Vec::with_capacity(names.len());
    for name in &names {
        let weights = (start.weights)(name, &shapes[name]).ok_or_else(|| error(0)(format!("no weights for {name}")))?;
        starting.push(weights);
    }
    let views: Vec<&[f32]> = starting.iter().map(Vec::as_slice).collect();
    let mut optimizer = AdamW::new(adamw, &views);
    optimizer.step = u64::from(start.step);
    if let Some(moments) = start.moments {
        for (name, state) in names.iter().zip(&mut optimizer.params) {
            let read = |suffix: &str| {
                moments(&format!("{name}.{suffix}"), &shapes[name])
                    .ok_or_else(|| error(0)(format!("no {suffix} moment for {name}")))
            };
            state.exp_avg = read("exp_avg")?;
            state.exp_avg_sq = read("exp_avg_sq")?;
        }
    }
    let positions: Vec<u32> = (0..seq as u32).collect();
    let routers: Vec<(ValueId, ValueId, u64)> = module
        .graph
        .order()
        .iter()
        .filter_map(|&node| {
            let data = module.graph.node(node);
            match data.op {
                Op::MoeMlp { top_k, .. } => Some((data.inputs[0], data.inputs[1], top_k)),
                _ => None,
            }
        })
        .collect();
    let mut routing_margins = Vec::new();
    let mut losses = Vec::new();
    let mut first_grads = HashMap::new();
    for step in start.step..start.step + steps {
        let weights: HashMap<&str, &[f32]> =
            names.iter().zip(&optimizer.params).map(|(name, state)| (name.as_str(), state.master.as_slice())).collect();
        let lookup = |name: &str, _shape: &[u64]| weights.get(name).map(|weight| weight.to_vec());
        let tokens = batches(step);
        let mut loss = 0.0_f32;
        let mut grads: Vec<Vec<f32>> = Vec::new();
        let mut margin = f64::INFINITY;
        for micro_tokens in tokens.chunks((rows * seq) as usize) {
            let inputs = Inputs { tokens: micro_tokens, positions: &positions, params: &lookup };
            let outputs = if routers.is_empty() {
                run_as_stored(&module.graph, &inputs).map_err(|err| error(step)(err.to_string()))?
            } else {
                // Keep every value to read each mixture's router inputs.
                let values = run_all_as_stored(&module.graph, &inputs).map_err(|err| error(step)(err.to_string()))?;
                for &(x, router, top_k) in &routers {
                    let (Some(x), Some(router)) = (values.get(x), values.get(router)) else { continue };
                    let layer = routing_margin(x, router, top_k).map_err(|err| error(step)(err.to_string()))?;
                    margin = margin.min(layer);
                }
                module.graph.outputs().iter().filter_map(|&value| values.get(value).cloned()).collect()
            };
            if micro_batches == 1 {
                loss = outputs[0].data[0];
                grads = outputs.into_iter().skip(1).map(|grad| grad.data).collect();
                continue;
            }
            let share = 1.0 / micro_batches as f32;
            loss += outputs[0].data[0] * share;
            grads.resize_with(outputs.len() - 1, Vec::new);
            for (sum, grad) in grads.iter_mut().zip(&outputs[1..]) {
                sum.resize(grad.data.len(), 0.0);
                sum.iter_mut().zip(&grad.data).for_each(|(sum, value)| *sum += value * share);
            }
        }
        losses.push(loss);
        routing_margins.push(margin);
        if step == start.step {
            first_grads = names.iter().cloned().zip(grads.iter().cloned()).collect();
        }
        let grads: Vec<&[f32]> = grads.iter().map(Vec::as_slice).collect();
        optimizer.step(&grads).map_err(|err| error(step)(err.to_string()))?;
    }
    let weights = names.into_iter().zip(optimizer.params.into_iter().map(|state| state.master)).collect();
    Ok(ReferenceTraining { losses, first_grads, weights, shapes, routing_margins })
}
