//! Reverse-mode automatic differentiation on the IR.
//!
//! `differentiate` appends the backward graph of a cross-entropy loss to the same graph, after the
//! loss in the program order: for every node the loss depends on (in reverse program order) it adds
//! the ops of `rules::operand_gradient` for each operand that depends on a parameter. A value with
//! several users gets the `Add` of their contributions. Every parameter name gets one gradient
//! value, named `grad.<checkpoint name>` and marked as a graph output; a name used by several
//! `param` nodes (tied embeddings seen twice) gets the sum. Guarantees: the result verifies when the
//! forward graph did, every gradient has its parameter's type, and nothing of the forward graph is
//! changed except the outputs list, which grows.
//!
//! The seed is implicit: `cross_entropy_grad` is the gradient of the loss itself (d loss / d loss =
//! 1), which is why the loss must be a `cross_entropy` node.

pub mod reference;
pub mod rules;

use std::collections::HashMap;

use pleat_ir::entity::EntityRef;
use pleat_ir::{AxisName, DType, Graph, Mesh, NodeData, NodeId, Op, Shape, ShardSpec, ValueId, ZERO_AXES};

use crate::sharding::{output_spec, spec_text, Conflict};
use rules::{operand_gradient, Vjp};

/// Which forward values the backward graph recomputes instead of keeping alive until it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    /// Keep every forward value the backward reads.
    #[default]
    None,
    /// Korthikanti et al.'s selective recomputation: recompute the attention core (its output is
    /// not kept; q, k and v are).
    Selective,
    /// Keep only the residual stream (the residual `add` results and operands: each block's input
    /// and output, in the layout the next layer reads it in) and the parameters; recompute the
    /// rest of each layer (bias adds included) from them in its backward.
    Full,
}

/// How `differentiate_with` builds the backward graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Options {
    /// What to recompute.
    pub recompute: Recompute,
    /// ZeRO's stage over a parameter's data-parallel axes (`pleat_ir::ZERO_AXES`: `dp`, `cp`, and
    /// `ep` where `ep` does not split it): 2 lays each gradient out split over them on its first dim
    /// (reduce-scatters instead of all-reduces); 3 re-gathers each split parameter in the backward
    /// instead of keeping the forward's gathered copy.
    pub zero_stage: u8,
}

impl Options {
    /// Whether the backward recomputes `node` rather than reading the forward's result.
    fn recomputes(&self, graph: &Graph, node: &NodeData) -> bool {
        if self.zero_stage >= 3 && graph.gathers_param(node) {
            return true;
        }
        // A broadcast weight block (TSP) is received again in the backward rather than kept from
        // the forward: keeping every owner's blocks would hold the whole unsharded model.
        if matches!(node.op, Op::BroadcastShard { .. }) {
            return true;
        }
        match self.recompute {
            Recompute::None => false,
            Recompute::Selective => matches!(node.op, Op::Attention { .. }),
            Recompute::Full => {
                // A residual add sums two values of its own shape; a bias add (q, k and v's under
                // Qwen2) broadcasts its bias, and is recomputed with the projection it follows.
                let residual_add = |node: &NodeData| {
                    let shape = &graph.value(node.result).ty.shape;
                    node.op == Op::Add && node.inputs.iter().all(|&input| &graph.value(input).ty.shape == shape)
                };
                let feeds_residual_add =
                    |value: ValueId| graph.users(value).iter().any(|&user| residual_add(graph.node(user)));
                // The stream in the layout the next layer reads it in is the stream too: beside cp,
                // SP gathers each layer's output (and the embedding's) whole over tp, and the next
                // layer's residual add reads its local slice of that. Recomputing the gathered copy
                // would, in a pipeline, make the stage that sent it compute it again in its backward
                // for the next stage's, which waits for it before sending that stage its gradient.
                let sliced_into_residual_add = graph.users(node.result).iter().any(|&user| {
                    let user = graph.node(user);
                    matches!(user.op, Op::LocalSlice { .. }) && feeds_residual_add(user.result)
                });
                let on_residual_stream = feeds_residual_add(node.result) || sliced_into_residual_add;
                node.op.arity() > 0
                    && !residual_add(node)
                    && !node.op.is_loss()
                    && !on_residual_stream
                    && graph.value(node.result).ty.dtype != DType::I32
            }
        }
    }
}

/// The gradient of one parameter.
#[derive(Clone, Debug, PartialEq)]
pub struct ParamGradient {
    /// The checkpoint name.
    pub name: String,
    /// The `param` values with that name (one, or more when a graph reads a weight twice).
    pub params: Vec<ValueId>,
    /// The gradient value (a graph output, its node named `grad.<name>`).
    pub grad: ValueId,
}

/// What `differentiate` added.
#[derive(Clone, Debug, PartialEq)]
pub struct Gradients {
    /// The loss that was differentiated.
    pub loss: ValueId,
    /// One entry a parameter name, in the program order of their first `param` node.
    pub params: Vec<ParamGradient>,
}

impl Gradients {
    /// The gradient value of the parameter `name`.
    pub fn get(&self, name: &str) -> Option<ValueId> {
        self.params.iter().find(|param| param.name == name).map(|param| param.grad)
    }
}

/// Why a graph cannot be differentiated.
#[derive(Clone, Debug, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum AutodiffError {
    /// The loss is not a value of the graph, or not in its program order.
    #[error("loss {value} is not computed by the graph; pass the value of its cross_entropy node")]
    #[diagnostic(code(E0410), help("pass the value of the graph's cross_entropy node"))]
    UnknownLoss {
        /// The value given.
        value: ValueId,
    },
    /// The loss is not a `cross_entropy` node.
    #[error("loss {value} ({name}) is computed by {op}, not cross_entropy; build the graph with build_training")]
    #[diagnostic(code(E0411), help("build the graph with build_training, whose loss is cross_entropy"))]
    NotCrossEntropy {
        /// The value given.
        value: ValueId,
        /// Its node's name.
        name: String,
        /// Its op.
        op: &'static str,
    },
    /// A node on the path from a parameter to the loss has no gradient rule.
    #[error("{node} ({name}): {reason}")]
    #[diagnostic(code(E0412), help("avoid the op on the path to the loss, or use a mesh whose ops have gradients"))]
    NoRule {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// What is missing, and how to avoid it.
        reason: String,
    },
    /// A backward op's operands are laid out in a way no collective inserted here reconciles.
    #[error("{name}: {reason}")]
    #[diagnostic(code(E0413), help("use a mesh or strategy whose backward layouts agree"))]
    NoLayout {
        /// The backward node's name.
        name: String,
        /// The sharding rule's conflict.
        reason: String,
    },
    /// A parameter the loss does not depend on: it would get no gradient.
    #[error("parameter `{name}` does not reach the loss, so it has no gradient; remove it or use it")]
    #[diagnostic(code(E0414), help("remove the parameter or use it in the forward graph"))]
    UnusedParam {
        /// The checkpoint name.
        name: String,
    },
}

/// Differentiates a training graph's loss (its `cross_entropy` output), after sharding: the
/// backward graph follows the forward's layouts and adds the conjugate collectives.
pub const DIFFERENTIATE: crate::Pass = crate::Pass { name: "differentiate", run: differentiate_loss };

fn differentiate_loss(module: &mut pleat_ir::Module, ctx: &crate::PassCtx) -> crate::Result<()> {
    let graph = &module.graph;
    let loss = graph.loss_node().map(|node| graph.node(node));
    let Some(loss) = loss.map(|node| node.result) else {
        return Err(crate::Error::UnexpectedGraph { pass: "differentiate", node: "loss".into() });
    };
    let options = Options { recompute: ctx.recompute, zero_stage: ctx.zero_stage };
    differentiate_with(&mut module.graph, &module.mesh, loss, &options)?;
    Ok(())
}

/// Appends the backward graph of `loss` (a `cross_entropy` value) to `graph` and returns the
/// gradient of every parameter.
pub fn differentiate(graph: &mut Graph, loss: ValueId) -> Result<Gradients, AutodiffError> {
    differentiate_with(graph, &Mesh::default(), loss, &Options::default())
}

/// As `differentiate`, on a graph sharded over `mesh`, recomputing and laying out gradients as
/// `options` say.
pub fn differentiate_with(
    graph: &mut Graph,
    mesh: &Mesh,
    loss: ValueId,
    options: &Options,
) -> Result<Gradients, AutodiffError> {
    if !graph.has_value(loss) {
        return Err(AutodiffError::UnknownLoss { value: loss });
    }
    // A loss with extra terms (the load-balancing loss) is their sum with the cross-entropy; each
    // term is seeded on its own below.
    let loss_node = match graph.def(loss).op {
        Op::Add => graph.loss_node().unwrap_or(graph.value(loss).def),
        _ => graph.value(loss).def,
    };
    let Some(loss_step) = graph.order().iter().position(|&node| node == loss_node) else {
        return Err(AutodiffError::UnknownLoss { value: loss });
    };
    let loss_data = graph.node(loss_node).clone();
    if !loss_data.op.is_loss() {
        return Err(AutodiffError::NotCrossEntropy { value: loss, name: loss_data.name, op: loss_data.op.mnemonic() });
    }
    let forward: Vec<NodeId> = graph.order()[..loss_step].to_vec();
    let depends_on_param = params_reach(graph, &forward);
    let first_new_value = graph.value_count();

    let mut state = Backward {
        graph,
        mesh,
        options: *options,
        first_new_value,
        cotangent: HashMap::new(),
        shared: HashMap::new(),
        collectives: Vec::new(),
        recomputed: HashMap::new(),
    };
    let logits = loss_data.inputs[0];
    if depends_on_param[logits.index()] {
        let seed_op = match loss_data.op {
            Op::VocabParallelCrossEntropy { axis } => Op::VocabParallelCrossEntropyGrad { axis },
            _ => Op::CrossEntropyGrad,
        };
        let seed = state.emit(seed_op, &loss_data.inputs, logits, &format!("{}.d0", loss_data.name))?;
        state.accumulate(logits, seed)?;
    }
    // The loss's other terms (the load-balancing loss, `counts · probabilities`) are seeded with 1
    // too: the probabilities' gradient is the counts, which carry none themselves.
    for &node_id in &forward {
        let node = state.graph.node(node_id);
        if node.op.is_loss_term() && depends_on_param[node.inputs[1].index()] {
            let (counts, probabilities) = (node.inputs[0], node.inputs[1]);
            state.accumulate(probabilities, counts)?;
        }
    }
    // A parameter's gradient is complete once the backward has passed its first user: it is laid
    // out as the parameter right there (all-reduced or reduce-scattered over dp), so that it does
    // not wait, whole and pending, for the end of the backward.
    let mut first_user: HashMap<ValueId, NodeId> = HashMap::new();
    for &node_id in &forward {
        for &input in &state.graph.node(node_id).inputs {
            if matches!(state.graph.def(input).op, Op::Param { .. }) {
                first_user.entry(input).or_insert(node_id);
            }
        }
    }
    for &node_id in forward.iter().rev() {
        let node = state.graph.node(node_id).clone();
        let complete: Vec<ValueId> =
            node.inputs.iter().copied().filter(|input| first_user.get(input) == Some(&node_id)).collect();
        let Some(&dy) = state.cotangent.get(&node.result) else { continue };
        // A gathered value's gradient is brought to the gathered layout before the gather's
        // conjugate sums it: a vocab-parallel embedding's gradient under ZeRO-3 is sliced to the
        // rank's tp rows first, so that dp reduce-scatters `[V/tp, h]`, not the whole `[V, h]`.
        let dy = match node.op {
            Op::AllGather { .. } if state.graph.value(dy).spec.dims != state.graph.value(node.result).spec.dims => {
                let target = ShardSpec {
                    dims: state.graph.value(node.result).spec.dims.clone(),
                    partial: state.graph.value(dy).spec.partial.clone(),
                };
                state.relayout(dy, &target)?
            }
            _ => dy,
        };
        for (operand, &input) in node.inputs.iter().enumerate() {
            if !depends_on_param[input.index()] {
                continue;
            }
            let no_rule = |error: rules::NoRule| AutodiffError::NoRule {
                node: node_id,
                name: node.name.clone(),
                reason: error.reason,
            };
            let contribution = match operand_gradient(state.graph, &node, operand, dy).map_err(no_rule)? {
                Vjp::Identity => dy,
                Vjp::Apply(op, operands) => {
                    let operands =
                        operands.into_iter().map(|operand| state.recompute(operand)).collect::<Result<Vec<_>, _>>()?;
                    state.emit(op, &operands, input, &format!("{}.d{operand}", node.name))?
                }
            };
            state.accumulate(input, contribution)?;
        }
        for param in complete {
            state.finish_param(param)?;
        }
    }
    state.collect_params(&forward, first_new_value).map(|params| Gradients { loss, params })
}

/// For each value of the graph, whether it depends on a parameter through float values (token ids
/// and positions carry no gradient).
fn params_reach(graph: &Graph, forward: &[NodeId]) -> Vec<bool> {
    let mut reach = vec![false; graph.value_count()];
    for &node_id in forward {
        let node = graph.node(node_id);
        let float = graph.value(node.result).ty.dtype != DType::I32;
        reach[node.result.index()] =
            float && (matches!(node.op, Op::Param { .. }) || node.inputs.iter().any(|input| reach[input.index()]));
    }
    reach
}

struct Backward<'a> {
    graph: &'a mut Graph,
    mesh: &'a Mesh,
    options: Options,
    /// Values from this index on are the backward graph's.
    first_new_value: usize,
    /// Forward values recomputed in the backward: forward value -> its recomputed copy.
    recomputed: HashMap<ValueId, ValueId>,
    /// The accumulated gradient of each forward value that has one.
    cotangent: HashMap<ValueId, ValueId>,
    /// How many forward values hold each gradient value (an identity rule shares one).
    shared: HashMap<ValueId, usize>,
    /// Collectives already emitted: (operand, op, result), so a second user reuses the first's.
    collectives: Vec<(ValueId, Op, ValueId)>,
}

impl Backward<'_> {
    /// Appends `op(operands)` with the type of `like` (a gradient has its primal's type) and the
    /// spec its sharding rule derives. An operand the rule rejects is first summed (a pending sum)
    /// or gathered (a split activation) by a collective appended just before, which later users of
    /// the same operand share; forward users are never rewired, so the forward graph is unchanged.
    fn emit(&mut self, op: Op, operands: &[ValueId], like: ValueId, name: &str) -> Result<ValueId, AutodiffError> {
        let ty = self.graph.value(like).ty.clone();
        let mut operands = operands.to_vec();
        loop {
            let graph = &*self.graph;
            let specs: Vec<&ShardSpec> = operands.iter().map(|&operand| &graph.value(operand).spec).collect();
            let shapes: Vec<&Shape> = operands.iter().map(|&operand| &graph.value(operand).ty.shape).collect();
            let probe = NodeData { op: op.clone(), inputs: operands.clone(), result: like, name: name.to_string() };
            match output_spec(&probe, &specs, &shapes, &ty.shape) {
                Ok(spec) => {
                    let result = self.graph.add(op, &operands, ty, name);
                    self.graph.value_mut(result).spec = spec;
                    return Ok(result);
                }
                Err(Conflict::PartialInput { operand, axes }) => {
                    let mut current = operands[operand];
                    for axis in axes {
                        current = self.collective(current, Op::AllReduce { axis }, "all_reduce")?;
                    }
                    operands[operand] = current;
                }
                Err(Conflict::SplitActivation { dim, axis }) => {
                    operands[0] = self.collective(operands[0], Op::AllGather { axis, dim }, "all_gather")?;
                }
                Err(Conflict::ScatterPartial { operand, axis, dim }) => {
                    let op = Op::ReduceScatter { axis, dim };
                    operands[operand] = self.collective(operands[operand], op, "reduce_scatter")?;
                }
                Err(Conflict::Layout(reason)) => {
                    return Err(AutodiffError::NoLayout { name: name.to_string(), reason });
                }
            }
        }
    }

    /// `value` as the backward reads it: the forward's result, or a copy recomputed here (with its
    /// recomputed operands) when the options recompute its node.
    fn recompute(&mut self, value: ValueId) -> Result<ValueId, AutodiffError> {
        if value.index() >= self.first_new_value {
            return Ok(value);
        }
        if let Some(&copy) = self.recomputed.get(&value) {
            return Ok(copy);
        }
        let node = self.graph.def(value).clone();
        if !self.options.recomputes(self.graph, &node) {
            return Ok(value);
        }
        let inputs = node.inputs.iter().map(|&input| self.recompute(input)).collect::<Result<Vec<_>, _>>()?;
        let ty = self.graph.value(value).ty.clone();
        let copy = self.graph.add(node.op.clone(), &inputs, ty, &format!("{}.recompute", node.name));
        self.graph.value_mut(copy).spec = self.graph.value(value).spec.clone();
        self.recomputed.insert(value, copy);
        Ok(copy)
    }

    /// `op` (a collective) on `value`, reusing one already emitted.
    fn collective(&mut self, value: ValueId, op: Op, suffix: &str) -> Result<ValueId, AutodiffError> {
        if let Some(&(_, _, result)) = self.collectives.iter().find(|(input, done, _)| *input == value && *done == op) {
            return Ok(result);
        }
        let name = format!("{}.{suffix}", self.graph.def(value).name);
        let result = self.emit(op.clone(), &[value], value, &name)?;
        self.collectives.push((value, op, result));
        Ok(result)
    }

    /// `value` converted to `target`'s layout: pending sums reduce-scattered onto the dim the target
    /// splits over that axis (or all-reduced), splits the target lacks gathered, splits it has
    /// sliced locally.
    fn relayout(&mut self, value: ValueId, target: &ShardSpec) -> Result<ValueId, AutodiffError> {
        let mut current = value;
        let shape = self.graph.value(value).ty.shape.clone();
        // Slice first what can be sliced while sums are still pending on other axes: the sums then
        // move only the rank's block (a vocab-parallel embedding's gradient is sliced on tp before
        // it is all-reduced over dp, not after).
        for dim in 0..shape.rank() {
            loop {
                let spec = &self.graph.value(current).spec;
                let (have, want) = (&spec.dims[dim], &target.dims[dim]);
                let Some(&axis) = want.get(have.len()).filter(|_| want.starts_with(have)) else { break };
                if spec.uses_axis(axis) {
                    break;
                }
                let dim = shape.dims()[dim].name;
                current = self.collective(current, Op::LocalSlice { axis, dim }, "local_slice")?;
            }
        }
        let mut pending: Vec<AxisName> = self
            .graph
            .value(current)
            .spec
            .partial
            .iter()
            .copied()
            .filter(|axis| !target.partial.contains(axis))
            .collect();
        while !pending.is_empty() {
            let spec = &self.graph.value(current).spec;
            let scatter_dim = |axis: AxisName| {
                (0..shape.rank()).find(|&dim| {
                    let (have, want) = (&spec.dims[dim], &target.dims[dim]);
                    want.len() > have.len() && want.starts_with(have) && want[have.len()] == axis
                })
            };
            // A sum the target splits a dim over after another pending sum's split waits for that
            // one: ZeRO's `[dp, cp, ep]` rows reduce-scatter over dp, then cp, then ep, whatever
            // order the sums are pending in, instead of all-reducing over ep and slicing.
            let next = pending
                .iter()
                .position(|&axis| scatter_dim(axis).is_some() || target.dim_sharded_by(axis).is_none())
                .unwrap_or(0);
            let axis = pending.remove(next);
            current = match scatter_dim(axis) {
                Some(dim) => {
                    let dim = shape.dims()[dim].name;
                    self.collective(current, Op::ReduceScatter { axis, dim }, "reduce_scatter")?
                }
                None => self.collective(current, Op::AllReduce { axis }, "all_reduce")?,
            };
        }
        for dim in 0..shape.rank() {
            while let Some(&axis) = self.graph.value(current).spec.dims[dim]
                .last()
                .filter(|_| !target.dims[dim].starts_with(&self.graph.value(current).spec.dims[dim]))
            {
                let dim = shape.dims()[dim].name;
                current = self.collective(current, Op::AllGather { axis, dim }, "all_gather")?;
            }
        }
        for dim in 0..shape.rank() {
            let have = self.graph.value(current).spec.dims[dim].len();
            for &axis in &target.dims[dim][have..] {
                let dim = shape.dims()[dim].name;
                current = self.collective(current, Op::LocalSlice { axis, dim }, "local_slice")?;
            }
        }
        let spec = &self.graph.value(current).spec;
        if spec != target {
            return Err(AutodiffError::NoLayout {
                name: self.graph.def(value).name.clone(),
                reason: format!(
                    "its gradient is laid out {} and cannot be brought to {}",
                    spec_text(spec, &shape),
                    spec_text(target, &shape)
                ),
            });
        }
        Ok(current)
    }

    /// Adds `contribution` to the gradient of `value`, in the earlier contribution's layout.
    fn accumulate(&mut self, value: ValueId, contribution: ValueId) -> Result<(), AutodiffError> {
        let total = match self.cotangent.get(&value) {
            None => contribution,
            Some(&earlier) => {
                let name = format!("{}.dsum", self.graph.def(value).name);
                self.release(earlier);
                let target = self.graph.value(earlier).spec.clone();
                let contribution = if self.graph.value(contribution).spec.dims == target.dims {
                    contribution
                } else {
                    self.relayout(contribution, &ShardSpec { partial: Vec::new(), ..target })?
                };
                self.emit(Op::Add, &[earlier, contribution], value, &name)?
            }
        };
        *self.shared.entry(total).or_default() += 1;
        self.cotangent.insert(value, total);
        Ok(())
    }

    fn release(&mut self, gradient: ValueId) {
        if let Some(count) = self.shared.get_mut(&gradient) {
            *count -= 1;
        }
    }

    /// The layout of `param`'s gradient: the parameter's, so each rank updates the block it holds;
    /// under ZeRO-2 only its data-parallel share of the rows (over `ZERO_AXES`).
    fn param_target(&self, param: ValueId) -> ShardSpec {
        let value = self.graph.value(param);
        let spec = value.spec.clone();
        if self.options.zero_stage == 2 {
            return spec.with_rows_split(&value.ty.shape, self.mesh, &ZERO_AXES).unwrap_or(spec);
        }
        spec
    }

    /// Lays out `param`'s complete gradient as `param_target` says.
    fn finish_param(&mut self, param: ValueId) -> Result<(), AutodiffError> {
        let Some(&gradient) = self.cotangent.get(&param) else { return Ok(()) };
        let target = self.param_target(param);
        let laid_out = self.relayout(gradient, &target)?;
        if laid_out != gradient {
            self.release(gradient);
            *self.shared.entry(laid_out).or_default() += 1;
            self.cotangent.insert(param, laid_out);
        }
        Ok(())
    }

    /// Sums the gradients of same-named parameters, names them `grad.<name>` and marks them outputs.
    fn collect_params(
        mut self,
        forward: &[NodeId],
        first_new_value: usize,
    ) -> Result<Vec<ParamGradient>, AutodiffError> {
        let mut params: Vec<ParamGradient> = Vec::new();
        for &node_id in forward {
            let node = self.graph.node(node_id);
            let Op::Param { name } = &node.op else { continue };
            let (name, value) = (name.clone(), node.result);
            let gradient = self.cotangent.get(&value).copied();
            match params.iter_mut().find(|param| param.name == name) {
                Some(param) => {
                    param.params.push(value);
                    if let Some(gradient) = gradient {
                        let target = self.graph.value(param.grad).spec.clone();
                        let gradient = self.relayout(gradient, &ShardSpec { partial: Vec::new(), ..target })?;
                        let sum = self.emit(Op::Add, &[param.grad, gradient], value, &format!("{name}.dsum"))?;
                        param.grad = sum;
                    }
                }
                None => {
                    let Some(gradient) = gradient else { return Err(AutodiffError::UnusedParam { name }) };
                    params.push(ParamGradient { name, params: vec![value], grad: gradient });
                }
            }
        }
        for param in &mut params {
            let target = self.param_target(param.params[0]);
            param.grad = self.relayout(param.grad, &target)?;
            // A gradient node another value shares (an identity rule) or a forward node keeps its
            // name: the parameter gets its own copy (`sum_leading` keeping every dim).
            let shared = self.shared.get(&param.grad).copied().unwrap_or(0) > 1;
            if shared || param.grad.index() < first_new_value {
                let rank = self.graph.value(param.grad).ty.shape.rank() as u8;
                param.grad = self.emit(Op::SumLeading { keep: rank }, &[param.grad], param.params[0], "copy")?;
            }
            let def = self.graph.value(param.grad).def;
            self.graph.node_mut(def).name = format!("grad.{}", param.name);
            self.graph.add_output(param.grad);
        }
        Ok(params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_ir::model::preset::preset;
    use pleat_ir::{AxisName, DimName, MlpOperand, TensorType};

    use DimName::{Batch, Hidden, Seq, Vocab};

    /// tokens -> embedding -> `middle` -> lm_head -> cross_entropy, on a one-token-wide toy model;
    /// `middle` adds nodes after the embedding and returns the value the head reads.
    fn toy(middle: impl FnOnce(&mut Graph, ValueId) -> ValueId) -> (Graph, ValueId) {
        let mut graph = Graph::new();
        let f32_ty = |dims: &[(DimName, u64)]| TensorType::new(DType::F32, dims);
        let tokens = graph.add(Op::Tokens, &[], TensorType::new(DType::I32, &[(Batch, 1), (Seq, 4)]), "tokens");
        let table = graph.add(Op::Param { name: "table".into() }, &[], f32_ty(&[(Vocab, 8), (Hidden, 2)]), "table");
        let embedded =
            graph.add(Op::Embedding, &[table, tokens], f32_ty(&[(Batch, 1), (Seq, 4), (Hidden, 2)]), "embed");
        let hidden = middle(&mut graph, embedded);
        let logits_ty = f32_ty(&[(Batch, 1), (Seq, 4), (Vocab, 8)]);
        let logits = graph.add(Op::MatMul { contract: 1 }, &[hidden, table], logits_ty, "lm_head");
        let loss = graph.add(Op::CrossEntropy, &[logits, tokens], f32_ty(&[]), "loss");
        graph.add_output(loss);
        (graph, loss)
    }

    #[test]
    fn the_loss_must_be_a_cross_entropy_value() {
        let config = preset("tiny").expect("tiny");
        let mut module = pleat_ir::model::build(&config, 1, 4).expect("build");
        let logits = module.graph.outputs()[0];
        let error = differentiate(&mut module.graph, logits).unwrap_err();
        assert_eq!(
            error.to_string(),
            format!(
                "loss {logits} (lm_head) is computed by matmul, not cross_entropy; build the graph with build_training"
            )
        );
        let missing = ValueId::new(module.graph.value_count());
        assert_eq!(differentiate(&mut module.graph, missing), Err(AutodiffError::UnknownLoss { value: missing }));
    }

    #[test]
    fn full_recomputation_keeps_the_residual_adds_and_recomputes_the_bias_adds() {
        // Qwen2's q, k and v bias adds broadcast a [heads, head_dim] bias over the tokens: keeping
        // them would hold three activations a layer across the backward that full recomputation
        // exists to drop. The residual adds (each block's input and output) are the stream it keeps.
        let config = pleat_ir::model::config::ModelConfig {
            architecture: pleat_ir::model::config::Architecture::Qwen2,
            attention_bias: true,
            ..preset("tiny").expect("tiny")
        };
        let module = pleat_ir::model::build_training(&config, 2, 16).expect("builds");
        let graph = &module.graph;
        let full = Options { recompute: Recompute::Full, zero_stage: 0 };
        let adds: Vec<&NodeData> =
            graph.order().iter().map(|&node| graph.node(node)).filter(|node| node.op == Op::Add).collect();
        let (bias_adds, residual_adds): (Vec<&NodeData>, Vec<&NodeData>) =
            adds.iter().partition(|node| node.name.ends_with("_bias"));
        assert_eq!(bias_adds.len() as u64, 3 * config.num_layers);
        assert_eq!(residual_adds.len() as u64, 2 * config.num_layers);
        assert!(bias_adds.iter().all(|node| full.recomputes(graph, node)), "a bias add is kept");
        assert!(residual_adds.iter().all(|node| !full.recomputes(graph, node)), "a residual add is recomputed");
        // Without recomputation both are kept.
        assert!(adds.iter().all(|node| !Options::default().recomputes(graph, node)));
    }

    #[test]
    fn a_weight_read_twice_gets_the_sum_of_both_uses() {
        let (mut graph, loss) = toy(|_, embedded| embedded);
        let gradients = differentiate(&mut graph, loss).expect("differentiates");
        assert_eq!(gradients.params.len(), 1);
        let grad = graph.def(gradients.params[0].grad);
        assert_eq!((grad.op.clone(), grad.name.as_str()), (Op::Add, "grad.table"));
        assert_eq!(graph.outputs(), [loss, gradients.params[0].grad]);
        let mut module = pleat_ir::Module { name: "toy".into(), mesh: Default::default(), graph };
        crate::verify(&module).expect("verifies");
        // The verifier's type rules see the backward ops: a wrong gradient type is reported.
        let embedding_grad = module.graph.def(gradients.params[0].grad).inputs[1];
        module.graph.value_mut(embedding_grad).ty = TensorType::new(DType::F32, &[(Vocab, 7), (Hidden, 2)]);
        let errors = crate::verify(&module).unwrap_err();
        assert!(errors.errors[0].message.contains("should be [vocab=8, hidden=2]"), "{errors}");
    }

    #[test]
    fn the_ring_mlp_gets_one_ring_gradient_per_operand() {
        let config = preset("tiny").expect("tiny");
        let mut module = pleat_ir::model::build_training(&config, 2, 16).expect("builds");
        module.mesh = pleat_ir::Mesh::parse("dp=2,tsp=2").expect("mesh");
        crate::run_pipeline(crate::TRAIN_PIPELINE, &mut module, &crate::PassCtx::default()).expect("trains");
        let graph = &module.graph;
        let dp = AxisName::parse("dp").expect("dp is an axis");
        for layer in 0..config.num_layers {
            let ring = graph.def(graph.find(&format!("layer{layer}.mlp_ring")).expect("a ring MLP"));
            let gradients: Vec<&NodeData> = graph
                .order()
                .iter()
                .map(|&node| graph.node(node))
                .filter(|node| matches!(node.op, Op::RingGatedMlpGrad { .. }) && node.inputs[..4] == ring.inputs[..])
                .collect();
            let wrts: Vec<MlpOperand> = gradients
                .iter()
                .filter_map(|node| match node.op {
                    Op::RingGatedMlpGrad { wrt, .. } => Some(wrt),
                    _ => None,
                })
                .collect();
            assert_eq!(wrts, MlpOperand::ALL, "layer {layer}");
            assert!(gradients.iter().all(|node| node.inputs[4] == gradients[0].inputs[4]), "one dy");
            // x's rows are split over dp too: the weight gradients are pending over dp alone, and
            // each parameter's gradient is their all-reduce.
            for (node, projection) in gradients[1..].iter().zip(["gate_proj", "up_proj", "down_proj"]) {
                assert_eq!(graph.value(node.result).spec.partial, [dp], "{}", node.name);
                let name = format!("model.layers.{layer}.mlp.{projection}.weight");
                let param_grad = graph.def(graph.find(&format!("grad.{name}")).expect("a gradient"));
                assert_eq!((&param_grad.op, param_grad.inputs[0]), (&Op::AllReduce { axis: dp }, node.result));
            }
        }
        // `explain` names one backward ring a layer, moving three [128, 128] f32 shards on its
        // D-1 = 1 hop and their gradients on D = 2, home to their owners.
        let rings: Vec<u64> = crate::explain::explain_collectives(&module)
            .iter()
            .filter(|reason| reason.rule == "ring-gradients-home-with-their-weights")
            .map(|reason| reason.bytes_per_rank)
            .collect();
        assert_eq!(rings, vec![(1 + 2) * 3 * 128 * 128 * 4; config.num_layers as usize]);
    }

    #[test]
    fn an_op_without_a_rule_is_named() {
        let (mut graph, loss) = toy(|graph, embedded| {
            let ty = graph.value(embedded).ty.clone();
            let positions = graph.find("tokens").expect("tokens");
            let axis = AxisName::parse("cp").expect("cp is an axis");
            let operands = [embedded, embedded, embedded, positions, positions];
            graph.add(Op::RingAttention { axis, causal: true }, &operands, ty, "attention")
        });
        let error = differentiate(&mut graph, loss).unwrap_err();
        assert!(
            matches!(&error, AutodiffError::NoRule { name, reason, .. } if name == "attention" && reason.contains("fold-cp")),
            "{error}"
        );
    }

    #[test]
    fn a_parameter_that_does_not_reach_the_loss_is_an_error() {
        let (mut graph, loss) = toy(|graph, embedded| {
            graph.add(Op::Param { name: "unused".into() }, &[], TensorType::new(DType::F32, &[(Hidden, 2)]), "unused");
            embedded
        });
        assert_eq!(differentiate(&mut graph, loss), Err(AutodiffError::UnusedParam { name: "unused".into() }));
    }
}
