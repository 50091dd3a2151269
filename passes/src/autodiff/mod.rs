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

pub mod rules;

use std::collections::HashMap;

use pleat_ir::entity::EntityRef;
use pleat_ir::{DType, Graph, NodeId, Op, ValueId};

use rules::{operand_gradient, Vjp};

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
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum AutodiffError {
    /// The loss is not a value of the graph, or not in its program order.
    #[error("loss {value} is not computed by the graph; pass the value of its cross_entropy node")]
    UnknownLoss {
        /// The value given.
        value: ValueId,
    },
    /// The loss is not a `cross_entropy` node.
    #[error("loss {value} ({name}) is computed by {op}, not cross_entropy; build the graph with build_training")]
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
    NoRule {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// What is missing, and how to avoid it.
        reason: String,
    },
    /// A parameter the loss does not depend on: it would get no gradient.
    #[error("parameter `{name}` does not reach the loss, so it has no gradient; remove it or use it")]
    UnusedParam {
        /// The checkpoint name.
        name: String,
    },
}

/// Appends the backward graph of `loss` (a `cross_entropy` value) to `graph` and returns the
/// gradient of every parameter.
pub fn differentiate(graph: &mut Graph, loss: ValueId) -> Result<Gradients, AutodiffError> {
    if !graph.has_value(loss) {
        return Err(AutodiffError::UnknownLoss { value: loss });
    }
    let loss_node = graph.value(loss).def;
    let Some(loss_step) = graph.order().iter().position(|&node| node == loss_node) else {
        return Err(AutodiffError::UnknownLoss { value: loss });
    };
    let loss_data = graph.node(loss_node).clone();
    if loss_data.op != Op::CrossEntropy {
        return Err(AutodiffError::NotCrossEntropy { value: loss, name: loss_data.name, op: loss_data.op.mnemonic() });
    }
    let forward: Vec<NodeId> = graph.order()[..loss_step].to_vec();
    let depends_on_param = params_reach(graph, &forward);
    let first_new_value = graph.value_count();

    let mut state = Backward { graph, cotangent: HashMap::new(), shared: HashMap::new() };
    let logits = loss_data.inputs[0];
    if depends_on_param[logits.index()] {
        let seed = state.emit(Op::CrossEntropyGrad, &loss_data.inputs, logits, &format!("{}.d0", loss_data.name));
        state.accumulate(logits, seed);
    }
    for &node_id in forward.iter().rev() {
        let node = state.graph.node(node_id).clone();
        let Some(&dy) = state.cotangent.get(&node.result) else { continue };
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
                Vjp::Apply(op, operands) => state.emit(op, &operands, input, &format!("{}.d{operand}", node.name)),
            };
            state.accumulate(input, contribution);
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
    /// The accumulated gradient of each forward value that has one.
    cotangent: HashMap<ValueId, ValueId>,
    /// How many forward values hold each gradient value (an identity rule shares one).
    shared: HashMap<ValueId, usize>,
}

impl Backward<'_> {
    /// Appends `op(operands)` with the type of `like` (a gradient has its primal's type).
    fn emit(&mut self, op: Op, operands: &[ValueId], like: ValueId, name: &str) -> ValueId {
        let ty = self.graph.value(like).ty.clone();
        self.graph.add(op, operands, ty, name)
    }

    /// Adds `contribution` to the gradient of `value`.
    fn accumulate(&mut self, value: ValueId, contribution: ValueId) {
        let total = match self.cotangent.get(&value) {
            None => contribution,
            Some(&earlier) => {
                let name = format!("{}.dsum", self.graph.def(value).name);
                self.release(earlier);
                self.emit(Op::Add, &[earlier, contribution], value, &name)
            }
        };
        *self.shared.entry(total).or_default() += 1;
        self.cotangent.insert(value, total);
    }

    fn release(&mut self, gradient: ValueId) {
        if let Some(count) = self.shared.get_mut(&gradient) {
            *count -= 1;
        }
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
                        let sum = self.emit(Op::Add, &[param.grad, gradient], value, &format!("{name}.dsum"));
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
            // A gradient node another value shares (an identity rule) or a forward node keeps its
            // name: the parameter gets its own copy (`sum_leading` keeping every dim).
            let shared = self.shared.get(&param.grad).copied().unwrap_or(0) > 1;
            if shared || param.grad.index() < first_new_value {
                let rank = self.graph.value(param.grad).ty.shape.rank() as u8;
                param.grad = self.emit(Op::SumLeading { keep: rank }, &[param.grad], param.params[0], "copy");
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
    use pleat_ir::{AxisName, DimName, TensorType};

    use DimName::{Batch, Ffn, Hidden, Seq, Vocab};

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
    fn an_op_without_a_rule_is_named() {
        let (mut graph, loss) = toy(|graph, embedded| {
            let weight = |graph: &mut Graph, name: &str, dims: &[(DimName, u64)]| {
                graph.add(Op::Param { name: name.into() }, &[], TensorType::new(DType::F32, dims), name)
            };
            let gate = weight(graph, "gate", &[(Ffn, 4), (Hidden, 2)]);
            let up = weight(graph, "up", &[(Ffn, 4), (Hidden, 2)]);
            let down = weight(graph, "down", &[(Hidden, 2), (Ffn, 4)]);
            let ty = graph.value(embedded).ty.clone();
            let axis = AxisName::parse("tsp").expect("tsp is an axis");
            graph.add(Op::RingGatedMlp { axis }, &[embedded, gate, up, down], ty, "mlp")
        });
        let error = differentiate(&mut graph, loss).unwrap_err();
        assert!(
            matches!(&error, AutodiffError::NoRule { name, reason, .. } if name == "mlp" && reason.contains("fold-tsp")),
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
