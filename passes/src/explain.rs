//! Explanations: why each collective of a sharded module is there, and what each value's layout is.
//!
//! The reasons are derived from the graph itself (the op that made a value a pending sum or split
//! it, and the op that could not take it so), so they stay true for any pass that produced the
//! graph. This is an analysis: it reads a module and changes nothing.

use pleat_ir::{DimName, Graph, MlpOperand, Module, MoeOperand, NodeId, Op, ValueId};

use crate::sharding::spec_text;

/// One collective and the reason for it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CollectiveReason {
    /// The collective's node.
    pub node: NodeId,
    /// Its name.
    pub name: String,
    /// The collective, as the text format spells it (`all_reduce`).
    pub op: &'static str,
    /// Its mesh axis.
    pub axis: String,
    /// The dim it splits or gathers, if any.
    pub dim: Option<String>,
    /// Bytes of the local block it starts from, on every rank (the message size); for a ring, the
    /// blocks of every hop (what the rank sends around it).
    pub bytes_per_rank: u64,
    /// The layer it belongs to (by its name), or `None` at the model's ends: a collective named
    /// after a layer's output whose users are all outside the layers (the gather before the final
    /// norm) is the model end's.
    pub layer: Option<u64>,
    /// The sharding rule that calls for it, kebab-case.
    pub rule: &'static str,
    /// Why, in words.
    pub reason: String,
}

/// One value's layout.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ValueLayout {
    /// The value.
    pub value: ValueId,
    /// Its node's name.
    pub name: String,
    /// Its op.
    pub op: &'static str,
    /// Its global shape and spec: `[batch, seq/tp, hidden] partial(dp)`.
    pub spec: String,
    /// Bytes a rank holds of it.
    pub bytes_per_rank: u64,
}

fn local_bytes(module: &Module, value: ValueId) -> u64 {
    let data = module.graph.value(value);
    let sizes = data.spec.local_sizes(&data.ty.shape, &module.mesh).unwrap_or_else(|_| data.ty.shape.sizes());
    sizes.iter().product::<u64>() * data.ty.dtype.size_bytes()
}

fn users_text(graph: &Graph, value: ValueId) -> String {
    let users: Vec<String> = graph
        .users(value)
        .iter()
        .map(|&user| format!("{} ({})", graph.node(user).name, graph.node(user).op.mnemonic()))
        .collect();
    if users.is_empty() {
        "the graph output".to_string()
    } else {
        users.join(", ")
    }
}

/// The layer `node` belongs to by its name (`layer3.` is 3), unless every user of its result is
/// outside the layers: then it serves the model's end.
fn layer_of(graph: &Graph, node: NodeId) -> Option<u64> {
    let layer = |node: NodeId| pleat_ir::model::builder::layer_of(&graph.node(node).name);
    let own = layer(node)?;
    let users = graph.users(graph.node(node).result);
    let serves_a_layer = users.is_empty() || users.iter().any(|&user| layer(user).is_some());
    serves_a_layer.then_some(own)
}

/// The first matmul `value` flows into through one-user elementwise and norm steps (a norm before
/// the LM head, say), if any.
fn matmul_downstream(graph: &Graph, value: ValueId) -> Option<NodeId> {
    let mut current = value;
    for _ in 0..8 {
        let users = graph.users(current);
        let &[user] = users.as_slice() else { return None };
        if matches!(graph.node(user).op, Op::MatMul { .. }) {
            return Some(user);
        }
        current = graph.node(user).result;
    }
    None
}

/// Whether `value` reaches a graph output through layout-only steps (gathers, zigzag).
fn feeds_output(graph: &Graph, value: ValueId) -> bool {
    let mut current = value;
    loop {
        if graph.outputs().contains(&current) {
            return true;
        }
        match graph.users(current).as_slice() {
            [user] if matches!(graph.node(*user).op, Op::AllGather { .. } | Op::Zigzag { .. }) => {
                current = graph.node(*user).result;
            }
            _ => return false,
        }
    }
}

/// Why `value` is a pending sum over `axis`.
fn why_partial(graph: &Graph, value: ValueId, axis: &str) -> String {
    let def = graph.def(value);
    match def.op {
        Op::MatMul { .. } => format!(
            "{} is Partial({axis}) after a row-parallel matmul: its contracted dim is split over {axis}",
            def.name
        ),
        Op::Embedding => format!(
            "{} is Partial({axis}) after a vocab-parallel embedding: each rank looks up only its rows",
            def.name
        ),
        _ => format!("{} is Partial({axis})", def.name),
    }
}

/// Every collective of `module` with its reason, in program order.
pub fn explain_collectives(module: &Module) -> Vec<CollectiveReason> {
    let graph = &module.graph;
    let mut reasons = Vec::new();
    for &node in graph.order() {
        let data = graph.node(node);
        let Some(axis) = data.op.axis().map(|axis| axis.to_string()) else { continue };
        if !data.op.is_communication() {
            continue;
        }
        let input = data.inputs[0];
        let input_name = &graph.def(input).name;
        let consumers = users_text(graph, data.result);
        let (dim, rule, reason) = match &data.op {
            Op::AllReduce { .. } => (
                None,
                "partial-needs-all-reduce",
                format!("{}; {consumers} needs the sum", why_partial(graph, input, &axis)),
            ),
            Op::ReduceScatter { dim, .. } => {
                // Tokens split on seq are sequence parallelism's; on batch, the rows that the
                // experts' all-gather dispatcher gathered go back to their ranks.
                let split = match dim {
                    DimName::Seq => " (sequence parallelism)",
                    DimName::Batch => " (each rank's own rows)",
                    _ => "",
                };
                (
                    Some(dim.to_string()),
                    "partial-then-reduce-scatter",
                    format!(
                        "{}; {consumers} takes it split on {dim}{split}, so the sum is scattered instead of all-reduced",
                        why_partial(graph, input, &axis)
                    ),
                )
            }
            Op::AllGather { dim, .. } => {
                let gathers_for_attention =
                    graph.users(data.result).iter().any(|&user| matches!(graph.node(user).op, Op::Attention { .. }));
                let (rule, reason) = if feeds_output(graph, data.result) {
                    ("outputs-are-replicated", format!("{input_name} is split on {dim} over {axis}; graph outputs are replicated on every rank"))
                } else if gathers_for_attention {
                    (
                        "attention-needs-whole-keys",
                        format!("{input_name} is split on {dim} over {axis}; attention needs every key and value of the sequence for its local queries"),
                    )
                } else {
                    // A norm may come first (the final norm before the LM head): name the matmul.
                    let multiplies = match graph.users(data.result).as_slice() {
                        [user] if !matches!(graph.node(*user).op, Op::MatMul { .. }) => {
                            match matmul_downstream(graph, data.result) {
                                Some(matmul) => format!(
                                    "{consumers} runs on it whole and {} ({}) multiplies it",
                                    graph.node(matmul).name,
                                    graph.node(matmul).op.mnemonic()
                                ),
                                None => format!("{consumers} multiplies it"),
                            }
                        }
                        _ => format!("{consumers} multiplies it"),
                    };
                    (
                        "split-activation-meets-split-weight",
                        format!(
                            "{input_name} is split on {dim} over {axis}, and {multiplies} by a weight split over {axis}: the activation is gathered to meet the column-parallel weight"
                        ),
                    )
                };
                (Some(dim.to_string()), rule, reason)
            }
            Op::BroadcastShard { dim, root, .. } => (
                Some(dim.to_string()),
                "broadcast-weights-instead-of-gather-activations",
                format!(
                    "rank {root} on {axis} owns this block of {input_name} (split on {dim}); TSP sends the weights to the tokens, so every rank computes owner {root}'s heads on its own tokens"
                ),
            ),
            Op::RingGatedMlp { .. } => (
                Some("ffn".to_string()),
                "ring-weights-around-local-tokens",
                format!(
                    "the gate/up/down shards (split on ffn over {axis}) travel around the {axis} ring, one hop a step under the step's GEMMs, while each rank's tokens stay put"
                ),
            ),
            // One ring computes all four gradients of an MLP: it is explained once, at its input's.
            Op::RingGatedMlpGrad { wrt, .. } if *wrt != MlpOperand::Input => continue,
            Op::RingGatedMlpGrad { .. } => (
                Some("ffn".to_string()),
                "ring-gradients-home-with-their-weights",
                format!(
                    "the backward runs the {axis} ring again: each gate/up/down shard travels with its gradient, every rank adds its own tokens' part, and the gradient arrives at the shard's owner complete, with no all-reduce"
                ),
            ),
            Op::RingAttention { .. } => (
                Some("seq".to_string()),
                "ring-kv-around-local-queries",
                format!(
                    "queries, keys and values are split on seq over {axis} (context parallelism); each rank keeps its queries while the key/value blocks, with their positions, travel around the {axis} ring, one hop a step under the step's attention, and the partial results merge by log-sum-exp"
                ),
            ),
            Op::VocabParallelCrossEntropy { .. } | Op::VocabParallelCrossEntropyGrad { .. } => (
                Some("vocab".to_string()),
                "vocab-parallel-loss",
                format!(
                    "{input_name} is split on vocab over {axis}; the ranks all-gather three numbers a row (max, sum of exponentials, target logit) and combine them into the loss, so the whole logits never exist on a rank"
                ),
            ),
            Op::MoeMlp { top_k, .. } => (
                Some("experts".to_string()),
                "tokens-travel-to-their-experts",
                format!(
                    "the experts are split over {axis} and so are {input_name}'s tokens: each rank sends each token to the ranks holding its {top_k} experts and gets their results back (an all-to-all with variable counts, the counts first), instead of gathering every token on every rank"
                ),
            ),
            // One dispatch computes all of a mixture's gradients: it is explained once, at its input's.
            Op::MoeMlpGrad { wrt, .. } if *wrt != MoeOperand::Input => continue,
            Op::MoeMlpGrad { .. } => (
                Some("experts".to_string()),
                "gradients-travel-with-their-tokens",
                format!(
                    "the backward sends each token's output gradient with the token to its experts' ranks over {axis}; the experts' weight gradients stay with their owners and each token's input gradient comes back"
                ),
            ),
            Op::AllToAll { split_dim, gather_dim, .. } => (
                Some(format!("{gather_dim}->{split_dim}")),
                "reshard-via-all-to-all",
                format!(
                    "{input_name} is split on {gather_dim} over {axis} and {consumers} takes it split on {split_dim}: one all-to-all re-splits it, moving (D-1)/D of the block instead of gathering it whole"
                ),
            ),
            _ => continue,
        };
        // A ring of D ranks passes a block on D-1 times (a gradient D times, home to its owner).
        let degree = data.op.axis().map_or(1, |axis| module.mesh.degree(axis));
        let hops = degree.saturating_sub(1);
        let bytes_per_rank = match &data.op {
            // The ring moves the three weight shards at every hop.
            Op::RingGatedMlp { .. } => {
                hops * data.inputs[1..].iter().map(|&weight| local_bytes(module, weight)).sum::<u64>()
            }
            // The backward ring moves the shards and, beside them, their gradients.
            Op::RingGatedMlpGrad { .. } => {
                (hops + degree) * data.inputs[1..4].iter().map(|&weight| local_bytes(module, weight)).sum::<u64>()
            }
            // The attention ring moves the key and value blocks and their positions at every hop.
            Op::RingAttention { .. } => {
                hops * [1, 2, 4].iter().map(|&operand| local_bytes(module, data.inputs[operand])).sum::<u64>()
            }
            // Each rank's row statistics: three f32 a row of the logits' local block.
            Op::VocabParallelCrossEntropy { .. } | Op::VocabParallelCrossEntropyGrad { .. } => {
                let logits = graph.value(input);
                let rows: u64 = logits
                    .spec
                    .local_sizes(&logits.ty.shape, &module.mesh)
                    .map_or(0, |sizes| sizes[..sizes.len().saturating_sub(1)].iter().product());
                rows * 3 * 4
            }
            // Under balanced routing, the (D-1)/D of each token's top_k copies that leave the rank, out
            // and back.
            Op::MoeMlp { top_k, .. } | Op::MoeMlpGrad { top_k, .. } => {
                let degree = data.op.axis().map_or(1, |axis| module.mesh.degree(axis));
                2 * top_k * local_bytes(module, input) * degree.saturating_sub(1) / degree.max(1)
            }
            _ => local_bytes(module, input),
        };
        reasons.push(CollectiveReason {
            node,
            layer: layer_of(graph, node),
            name: data.name.clone(),
            op: data.op.mnemonic(),
            axis,
            dim,
            bytes_per_rank,
            rule,
            reason,
        });
    }
    reasons
}

/// The layout of every value whose name starts with `prefix` (e.g. `layer0.`), in program order.
pub fn value_layouts(module: &Module, prefix: &str) -> Vec<ValueLayout> {
    let graph = &module.graph;
    graph
        .order()
        .iter()
        .map(|&node| graph.node(node))
        .filter(|data| data.name.starts_with(prefix))
        .map(|data| {
            let value = graph.value(data.result);
            ValueLayout {
                value: data.result,
                name: data.name.clone(),
                op: data.op.mnemonic(),
                spec: spec_text(&value.spec, &value.ty.shape),
                bytes_per_rank: local_bytes(module, data.result),
            }
        })
        .collect()
}
