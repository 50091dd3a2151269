//! The reference interpreter: pleat's numeric oracle.
//!
//! `run` evaluates an unsharded graph node by node in program order with plain f32 loops that follow
//! Hugging Face's `LlamaForCausalLM` forward pass: RMSNorm as `weight * (x * rsqrt(mean(x^2) + eps))`,
//! rotary embedding with HF's frequencies and rotate-half layout, grouped-query attention with scale
//! `head_dim^-0.5` and a causal mask on absolute positions, gated SiLU MLP. Training graphs run too:
//! the causal-LM cross-entropy loss as HF's `ForCausalLMLoss` computes it and every backward op
//! (`grad`, `attention_grad`), each checked against finite differences of its forward op
//! (`grad_tests`). It favours being obviously
//! right over being fast: no tiling, no threads, no unsafe. Sums accumulate in f64 and round once,
//! so its own error is far below the tolerances it is compared with and does not depend on loop order.
//!
//! Values are f32 whatever dtype the graph declares; `run_as_stored` and `run_all_as_stored` also
//! round each bf16 value as the runtime stores it, to be the reference of bf16 programs. Ops are functions of their operand tensors
//! (`eval`); only the driver here reads the run's inputs and parameters, so a lock-step multi-rank
//! simulation can reuse the op functions on local blocks. For now a graph with a non-replicated spec
//! or a communication op is `InterpError::Sharded`. Bad graphs and bad inputs are errors, never
//! panics. Every node's result is checked against the shape its value's type declares.

mod attention;
mod attention_grad;
mod error;
mod grad;
#[cfg(test)]
mod grad_tests;
mod moe;
mod ops;
mod rope;
mod tensor;

#[cfg(test)]
mod tests;

pub use error::{InterpError, OpError};
pub use moe::{routing_margin, routing_margins};
pub use ops::eval;
pub use tensor::Tensor;

use tensor::EXACT_INTEGER_LIMIT;

use crate::entity::EntityRef;
use crate::{Graph, NodeData, NodeId, Op, ShardSpec, ValueId};

/// Inputs of one forward run of an unsharded graph.
pub struct Inputs<'a> {
    /// The token ids, `batch * seq` of them, row-major (`Op::Tokens`).
    pub tokens: &'a [u32],
    /// The absolute position of each sequence slot, `seq` of them (`Op::Positions`).
    pub positions: &'a [u32],
    /// Looks up a weight by checkpoint name and the shape the graph expects; returns its elements in
    /// row-major order, or `None` when it has no such weight.
    pub params: &'a ParamLookup<'a>,
}

/// A weight lookup: checkpoint name and expected shape in, row-major elements out (`None`: no such
/// weight).
pub type ParamLookup<'a> = dyn Fn(&str, &[u64]) -> Option<Vec<f32>> + 'a;

/// Every value one run computed, keyed by `ValueId`.
#[derive(Clone, Debug, Default)]
pub struct Values {
    tensors: Vec<Option<Tensor>>,
}

impl Values {
    /// The tensor of `value`, if the run computed it.
    pub fn get(&self, value: ValueId) -> Option<&Tensor> {
        self.tensors.get(value.index()).and_then(Option::as_ref)
    }

    /// Every computed value with its tensor, in `ValueId` order.
    pub fn iter(&self) -> impl Iterator<Item = (ValueId, &Tensor)> + '_ {
        self.tensors.iter().enumerate().filter_map(|(index, tensor)| Some((ValueId::new(index), tensor.as_ref()?)))
    }
}

/// Runs every node in program order; returns the graph outputs. Each value is dropped after its
/// last use, so memory stays near one layer's weights and activations.
pub fn run(graph: &Graph, inputs: &Inputs) -> Result<Vec<Tensor>, InterpError> {
    outputs(graph, inputs, Storage::F32)
}

/// As `run`, with every value stored as the runtime stores its declared dtype: a bf16 value is
/// rounded to nearest even as soon as it is computed, as the runtime rounds what it writes to a
/// bf16 buffer (it keeps every other float dtype in f32).
/// The reference of a bf16 program: both round at the same values, so what is left between them
/// is f32 summation order (a rounding flipped here and there by a last bit), not the compounded
/// error of running every layer in another precision.
pub fn run_as_stored(graph: &Graph, inputs: &Inputs) -> Result<Vec<Tensor>, InterpError> {
    outputs(graph, inputs, Storage::AsDeclared)
}

fn outputs(graph: &Graph, inputs: &Inputs, storage: Storage) -> Result<Vec<Tensor>, InterpError> {
    let values = execute(graph, inputs, Retention::OutputsOnly, storage)?;
    graph
        .outputs()
        .iter()
        .map(|&value| values.get(value).cloned().ok_or(InterpError::MissingOutput { value }))
        .collect()
}

/// Same as `run`, but returns every value computed (for debugging and per-value comparisons).
pub fn run_all(graph: &Graph, inputs: &Inputs) -> Result<Values, InterpError> {
    all_values(graph, inputs, Storage::F32)
}

/// As `run_all`, every value stored at its declared dtype (`run_as_stored`).
pub fn run_all_as_stored(graph: &Graph, inputs: &Inputs) -> Result<Values, InterpError> {
    all_values(graph, inputs, Storage::AsDeclared)
}

fn all_values(graph: &Graph, inputs: &Inputs, storage: Storage) -> Result<Values, InterpError> {
    let values = execute(graph, inputs, Retention::All, storage)?;
    if let Some(&value) = graph.outputs().iter().find(|&&value| values.get(value).is_none()) {
        return Err(InterpError::MissingOutput { value });
    }
    Ok(values)
}

/// Which computed values a run keeps.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Retention {
    All,
    OutputsOnly,
}

/// How a run stores the values it computes.
#[derive(Copy, Clone, PartialEq, Eq)]
enum Storage {
    /// In f32, whatever dtype the graph declares.
    F32,
    /// Rounded to the declared dtype.
    AsDeclared,
}

fn execute(graph: &Graph, inputs: &Inputs, retention: Retention, storage: Storage) -> Result<Values, InterpError> {
    check_unsharded(graph)?;
    let last_use = last_uses(graph);
    let mut values = Values { tensors: (0..graph.value_count()).map(|_| None).collect() };
    for (step, &node_id) in graph.order().iter().enumerate() {
        let node = graph.node(node_id);
        let mut tensor = evaluate(graph, node_id, node, inputs, &values)?;
        if storage == Storage::AsDeclared {
            tensor.round_to(graph.value(node.result).ty.dtype);
        }
        let declared = declared_shape(graph, node.result);
        if tensor.shape != declared {
            return Err(InterpError::ResultShape {
                node: node_id,
                name: node.name.clone(),
                computed: tensor.shape,
                declared,
            });
        }
        values.tensors[node.result.index()] = Some(tensor);
        if retention == Retention::OutputsOnly {
            for value in node.inputs.iter().copied().chain([node.result]) {
                if last_use[value.index()] <= Some(step) {
                    values.tensors[value.index()] = None;
                }
            }
        }
    }
    Ok(values)
}

/// For each value, the last program step that reads it: `None` when nothing does, `usize::MAX` for
/// graph outputs (never dropped).
fn last_uses(graph: &Graph) -> Vec<Option<usize>> {
    let mut last_use = vec![None; graph.value_count()];
    for (step, &node) in graph.order().iter().enumerate() {
        for &input in &graph.node(node).inputs {
            if let Some(slot) = last_use.get_mut(input.index()) {
                *slot = Some(step);
            }
        }
    }
    for &output in graph.outputs() {
        if let Some(slot) = last_use.get_mut(output.index()) {
            *slot = Some(usize::MAX);
        }
    }
    last_use
}

/// The shape of `value`'s type as `usize` sizes (pleat targets 64-bit hosts, where the cast is exact).
fn declared_shape(graph: &Graph, value: ValueId) -> Vec<usize> {
    graph.value(value).ty.shape.sizes().into_iter().map(|size| size as usize).collect()
}

/// Refuses communication ops and values that are not replicated, before any work is done.
fn check_unsharded(graph: &Graph) -> Result<(), InterpError> {
    for &node_id in graph.order() {
        let node = graph.node(node_id);
        let sharded = |detail: String| InterpError::Sharded { node: node_id, name: node.name.clone(), detail };
        if matches!(
            node.op,
            Op::AllReduce { .. }
                | Op::ReduceScatter { .. }
                | Op::AllGather { .. }
                | Op::LocalSlice { .. }
                | Op::BroadcastShard { .. }
                | Op::AllToAll { .. }
        ) {
            return Err(sharded(format!("op {} moves data between ranks", node.op.mnemonic())));
        }
        let value = graph.value(node.result);
        if !value.spec.is_replicated() {
            let names = value.ty.shape.names();
            return Err(sharded(format!("{} is {}", node.result, describe_spec(&value.spec, &names))));
        }
    }
    Ok(())
}

/// `split over tp on dim 2 (ffn), partial over dp`.
fn describe_spec(spec: &ShardSpec, names: &[crate::DimName]) -> String {
    let mut parts: Vec<String> = spec
        .dims
        .iter()
        .enumerate()
        .filter(|(_, axes)| !axes.is_empty())
        .map(|(dim, axes)| {
            let axes: Vec<&str> = axes.iter().map(|axis| axis.as_str()).collect();
            let name = names.get(dim).map_or("?", |name| name.as_str());
            format!("split over {} on dim {dim} ({name})", axes.join(","))
        })
        .collect();
    if !spec.partial.is_empty() {
        let axes: Vec<&str> = spec.partial.iter().map(|axis| axis.as_str()).collect();
        parts.push(format!("partial over {}", axes.join(",")));
    }
    parts.join(", ")
}

/// Computes one node's tensor: the run's inputs for `Tokens`, `Positions` and `Param`, the op table
/// for everything else.
fn evaluate(
    graph: &Graph,
    node_id: NodeId,
    node: &NodeData,
    inputs: &Inputs,
    values: &Values,
) -> Result<Tensor, InterpError> {
    let name = || node.name.clone();
    let op_error = |error| InterpError::Op { node: node_id, name: name(), op: node.op.mnemonic(), error };
    if node.inputs.len() != node.op.arity() {
        return Err(op_error(OpError::Arity { expected: node.op.arity(), got: node.inputs.len() }));
    }
    let shape = declared_shape(graph, node.result);
    match &node.op {
        Op::Tokens => integer_input(node_id, node, "tokens", inputs.tokens, shape),
        Op::Positions => integer_input(node_id, node, "positions", inputs.positions, shape),
        Op::Param { name: param } => {
            let sizes = graph.value(node.result).ty.shape.sizes();
            let Some(data) = (inputs.params)(param, &sizes) else {
                return Err(InterpError::MissingParam {
                    node: node_id,
                    name: name(),
                    param: param.clone(),
                    shape: sizes,
                });
            };
            let expected = tensor::element_count(&shape);
            if data.len() != expected {
                return Err(InterpError::ParamLength {
                    node: node_id,
                    name: name(),
                    param: param.clone(),
                    shape: sizes,
                    expected,
                    got: data.len(),
                });
            }
            Ok(Tensor { shape, data })
        }
        Op::Zigzag { parts, inverse } => {
            let input = node.inputs[0];
            let operand =
                values.get(input).ok_or(InterpError::Undefined { node: node_id, name: name(), value: input })?;
            let input_shape = &graph.value(input).ty.shape;
            let Some(dim) = input_shape.position(crate::DimName::Seq) else {
                return Err(op_error(OpError::OperandShape {
                    operand: 0,
                    shape: operand.shape.clone(),
                    expected: "a value with a seq dim".into(),
                }));
            };
            let order = crate::op::zigzag_order(input_shape.dims()[dim].size, *parts);
            let order = if *inverse { crate::op::inverse_order(&order) } else { order };
            Ok(ops::permute_dim(operand, dim, &order))
        }
        op => {
            let operands = node
                .inputs
                .iter()
                .map(|&value| {
                    let defined = graph.has_value(value).then(|| values.get(value)).flatten();
                    defined.ok_or(InterpError::Undefined { node: node_id, name: name(), value })
                })
                .collect::<Result<Vec<&Tensor>, InterpError>>()?;
            eval(op, &operands).map_err(op_error)
        }
    }
}

/// The tensor of the `tokens` or `positions` input, checked against the graph's shape and f32's
/// exact-integer range.
fn integer_input(
    node_id: NodeId,
    node: &NodeData,
    input: &'static str,
    entries: &[u32],
    shape: Vec<usize>,
) -> Result<Tensor, InterpError> {
    let expected = tensor::element_count(&shape);
    if entries.len() != expected {
        return Err(InterpError::InputLength {
            node: node_id,
            name: node.name.clone(),
            input,
            expected,
            got: entries.len(),
            shape,
        });
    }
    if let Some((index, &value)) = entries.iter().enumerate().find(|(_, &value)| value >= EXACT_INTEGER_LIMIT) {
        return Err(InterpError::InputTooLarge { node: node_id, name: node.name.clone(), input, index, value });
    }
    // Exact: every entry is below 2^24.
    Ok(Tensor { shape, data: entries.iter().map(|&value| value as f32).collect() })
}
