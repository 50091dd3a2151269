//! Strategies: seed specs on parameters and inputs from the mesh's axes.
//!
//! A strategy only says how the leaves are laid out; propagation (`propagate`) derives every other
//! spec and inserts the collectives the layouts call for. Each mesh axis names its strategy:
//! - `tp`, Megatron tensor parallelism: q/k/v and gate/up are column-parallel (split on their
//!   output dim: heads, kv_heads, ffn), o and down row-parallel (split on their input dim), the
//!   embedding and LM head vocab-parallel. When the kv heads do not divide by tp, the k/v
//!   projections are replicated and each rank's attention reads the kv heads of its query heads
//!   (Megatron keeps only the kv group a rank needs; pleat keeps all kv heads, which costs
//!   `2·(kv_heads - kv_heads/tp)·head_dim·hidden` more weights a rank and no communication).
//!   Sequence parallelism (`PassCtx::sequence_parallel`) seeds nothing more: propagation chooses
//!   reduce-scatters and all-gathers on seq instead of all-reduces.
//! - `tsp`, tensor-and-sequence parallelism: weights split exactly as for `tp` (kv heads must
//!   divide); the token split and the layer structure come from the `fold-tsp` pass.
//! - `dp`, data parallelism: the batch is split; weights are replicated.
//! - `cp`, context parallelism: weights are replicated (kv heads need not divide anything); the
//!   zigzag token split and the ring attention come from the `fold-cp` pass.
//! - `ep`, expert parallelism: each rank holds `experts/ep` of every layer's routed experts, and the
//!   batch is split over `ep` as over `dp` (the dense layers are data parallel over it). The
//!   experts' rule gathers each rank's tokens over `ep` and their pending sum is reduce-scattered
//!   back (Megatron's all-gather token dispatcher). Under `tp` the experts are split on ffn (expert
//!   tensor parallelism); under `tsp` they stay whole, so `tsp` shards attention and `ep` the
//!   experts. Without `ep`, `tsp` places the experts itself (`experts/tsp` a rank): its tokens are
//!   already split over it, so its ranks dispatch their own tokens to the experts' ranks (expert
//!   parallelism on the same axis).

use pleat_ir::spec::valid_degrees;
use pleat_ir::{AxisName, DimName, Module, Op};

use crate::error::{Error, Result};
use crate::manager::PassCtx;

/// The axes this build has strategies for.
pub const SUPPORTED_AXES: [AxisName; 5] = [AxisName::Dp, AxisName::Tp, AxisName::Tsp, AxisName::Cp, AxisName::Ep];

/// Pairs of supported axes no one mesh may hold together, and why: `fold-tsp` and `fold-cp`
/// refuse them with these reasons.
pub const CONFLICTING_AXES: [(AxisName, AxisName, &str); 2] = [
    (
        AxisName::Tsp,
        AxisName::Tp,
        "both split the weights (tsp already is tensor parallelism, with the tokens split too)",
    ),
    (AxisName::Tsp, AxisName::Cp, "both split the sequence"),
];

/// The conflicting pair's error, if `mesh` holds `first` and `second`.
pub(crate) fn conflict(mesh: &pleat_ir::Mesh, first: AxisName, second: AxisName) -> Result<()> {
    let pair = CONFLICTING_AXES.iter().find(|(a, b, _)| (*a, *b) == (first, second) || (*a, *b) == (second, first));
    match pair {
        Some((a, b, reason)) if mesh.axis(first).is_some() && mesh.axis(second).is_some() => {
            Err(Error::ConflictingAxes { first: a.to_string(), second: b.to_string(), reason: (*reason).into() })
        }
        _ => Ok(()),
    }
}

/// Seeds parameter and input specs for every axis of the module's mesh. Only leaves change, so the
/// module is consistent again only once propagation has run: the two form one pass.
pub fn seed_leaves(module: &mut Module, ctx: &PassCtx) -> Result<()> {
    for axis in module.mesh.axes().to_vec() {
        match axis.name {
            // (A training step's pp axis is taken off the mesh before its stages are sharded.)
            AxisName::Pp => return Err(Error::PipelineInference),
            AxisName::Tp => seed_weight_splits(module, AxisName::Tp, axis.size)?,
            // TSP splits every weight as TP does (its attention and MLP take whole kv groups, so kv
            // heads must divide too); `fold-tsp` restructures the layers and splits the tokens.
            AxisName::Tsp => {
                seed_weight_splits(module, AxisName::Tsp, axis.size)?;
                // Without an `ep` axis the routed experts are placed over `tsp` itself: its
                // tokens are already split over it, so the same ranks dispatch them.
                if module.mesh.degree(AxisName::Ep) == 1 && has_experts(&module.graph) {
                    seed_expert_parallel(module, AxisName::Tsp, axis.size, !ctx.expert_all_gather)?;
                }
            }
            AxisName::Dp => seed_data_parallel(module, axis.size)?,
            AxisName::Ep => seed_expert_parallel(module, AxisName::Ep, axis.size, !ctx.expert_all_gather)?,
            // Weights stay whole on every cp rank; the sequence split is placed by `fold-cp`.
            AxisName::Cp => {}
            other => {
                return Err(Error::UnsupportedAxis {
                    axis: other.to_string(),
                    available: SUPPORTED_AXES.iter().map(|axis| axis.as_str()).collect(),
                })
            }
        }
    }
    Ok(())
}

fn indivisible(node: &str, what: DimName, count: u64, axis: AxisName, degree: u64) -> Error {
    Error::Ir(pleat_ir::Error::Indivisible {
        node: node.to_string(),
        what: match what {
            DimName::Heads => "heads",
            DimName::KvHeads => "kv heads",
            DimName::Ffn => "ffn channels",
            DimName::Vocab => "vocab rows",
            DimName::Batch => "sequences (batch)",
            DimName::Seq => "tokens (seq)",
            DimName::Hidden => "hidden channels",
            DimName::HeadDim => "head_dim channels",
            DimName::Experts => "experts",
        }
        .to_string(),
        count,
        axis: axis.to_string(),
        degree,
        valid: valid_degrees(count),
    })
}

/// Which dim of a Hugging Face Llama-family weight tensor parallelism splits, if any.
fn tensor_parallel_dim(name: &str) -> Option<DimName> {
    const SPLITS: [(&str, DimName); 15] = [
        ("embed_tokens.weight", DimName::Vocab),
        ("lm_head.weight", DimName::Vocab),
        ("q_proj.weight", DimName::Heads),
        ("q_proj.bias", DimName::Heads),
        ("k_proj.weight", DimName::KvHeads),
        ("k_proj.bias", DimName::KvHeads),
        ("v_proj.weight", DimName::KvHeads),
        ("v_proj.bias", DimName::KvHeads),
        ("o_proj.weight", DimName::Heads),
        ("gate_proj.weight", DimName::Ffn),
        ("up_proj.weight", DimName::Ffn),
        ("down_proj.weight", DimName::Ffn),
        // Mixtral's experts (w1 gate, w3 up, w2 down): expert tensor parallelism.
        ("experts.w1.weight", DimName::Ffn),
        ("experts.w3.weight", DimName::Ffn),
        ("experts.w2.weight", DimName::Ffn),
    ];
    SPLITS.iter().find(|(suffix, _)| name.ends_with(suffix)).map(|&(_, dim)| dim)
}

/// A weight `axis` splits: its value, name, the dim split, that dim's position and size.
pub(crate) struct WeightSplit<'a> {
    value: pleat_ir::ValueId,
    name: &'a str,
    dim: DimName,
    position: usize,
    count: u64,
}

/// Every weight `axis` (tp or tsp) splits, with the dim it splits.
pub(crate) fn weight_splits(graph: &pleat_ir::Graph, axis: AxisName) -> Vec<WeightSplit<'_>> {
    let mut splits = Vec::new();
    for (value, name) in graph.params() {
        let Some(dim) = tensor_parallel_dim(name) else { continue };
        let shape = &graph.value(value).ty.shape;
        // TSP's rings move dense weights; routed experts stay whole on its ranks (`ep` places them).
        if axis == AxisName::Tsp && shape.position(DimName::Experts).is_some() {
            continue;
        }
        if let (Some(position), Some(count)) = (shape.position(dim), shape.size_of(dim)) {
            splits.push(WeightSplit { value, name, dim, position, count });
        }
    }
    splits
}

/// Whether `axis` must divide a weight's `dim`: every split dim but tp's kv heads, which may stay
/// whole (TSP's attention and MLP take whole kv groups).
pub(crate) fn must_divide(dim: DimName, axis: AxisName) -> bool {
    dim != DimName::KvHeads || axis == AxisName::Tsp
}

/// The count every degree of `axis` must divide for its weight splits: their sizes' gcd (0 when
/// it splits none).
pub(crate) fn weight_split_gcd(graph: &pleat_ir::Graph, axis: AxisName) -> u64 {
    weight_splits(graph, axis)
        .iter()
        .filter(|split| must_divide(split.dim, axis))
        .fold(0, |acc, split| gcd(acc, split.count))
}

fn seed_weight_splits(module: &mut Module, axis: AxisName, degree: u64) -> Result<()> {
    let graph = &module.graph;
    let splits = weight_splits(graph, axis);
    // Every split dim but the kv heads (which may stay whole) must divide; the error names the
    // first one a user thinks of (heads, then ffn, then vocab); the pass manager narrows the
    // degrees it offers to those every check on the axis accepts (`degrees`).
    let priority = |dim: DimName| [DimName::Heads, DimName::Ffn, DimName::Vocab].iter().position(|&d| d == dim);
    if let Some(split) = splits
        .iter()
        .filter(|split| must_divide(split.dim, axis) && split.count % degree != 0)
        .min_by_key(|split| priority(split.dim))
    {
        return Err(indivisible(split.name, split.dim, split.count, axis, degree));
    }
    let placed: Vec<_> = splits
        .into_iter()
        // Grouped-query attention with more ranks than kv heads: keep k/v whole on every rank.
        .filter(|split| split.dim != DimName::KvHeads || split.count % degree == 0)
        .map(|split| (split.value, split.position))
        .collect();
    for (value, position) in placed {
        // Seeding runs again when several passes propagate; an axis is placed once.
        let axes = &mut module.graph.value_mut(value).spec.dims[position];
        if !axes.contains(&axis) {
            axes.push(axis);
        }
    }
    Ok(())
}

pub(crate) fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

/// The values of the graph's `tokens` nodes.
pub(crate) fn token_values(graph: &pleat_ir::Graph) -> Vec<pleat_ir::ValueId> {
    graph
        .order()
        .iter()
        .filter(|&&node| graph.node(node).op == Op::Tokens)
        .map(|&node| graph.node(node).result)
        .collect()
}

fn seed_data_parallel(module: &mut Module, degree: u64) -> Result<()> {
    check_batch_split(module, AxisName::Dp, degree)?;
    let graph = &mut module.graph;
    for value in token_values(graph) {
        // Outermost: expert parallelism gathers its own (innermost) split of the batch.
        let axes = &mut graph.value_mut(value).spec.dims[0];
        if !axes.contains(&AxisName::Dp) {
            axes.insert(0, AxisName::Dp);
        }
    }
    Ok(())
}

/// The axes that split the batch: dp, and ep (the dense layers are data parallel over it).
pub const BATCH_AXES: [AxisName; 2] = [AxisName::Dp, AxisName::Ep];

/// Checks that the batch splits over `axis` (of `degree`) beside the batch axes before it in the
/// mesh: the batch splits over all of them at once, so each is checked against what the earlier
/// ones leave a rank, and the error names those.
fn check_batch_split(module: &Module, axis: AxisName, degree: u64) -> Result<()> {
    let earlier: Vec<_> = module
        .mesh
        .axes()
        .iter()
        .take_while(|earlier| earlier.name != axis)
        .filter(|earlier| BATCH_AXES.contains(&earlier.name))
        .collect();
    let before: u64 = earlier.iter().map(|earlier| earlier.size).product();
    for value in token_values(&module.graph) {
        let batch = module.graph.value(value).ty.shape.size_of(DimName::Batch).unwrap_or(1);
        let share = batch / before;
        if share % degree != 0 {
            let mut error = indivisible("tokens", DimName::Batch, share, axis, degree);
            if let (Error::Ir(pleat_ir::Error::Indivisible { what, .. }), false) = (&mut error, earlier.is_empty()) {
                let over: Vec<String> =
                    earlier.iter().map(|earlier| format!("{}={}", earlier.name, earlier.size)).collect();
                *what = format!("sequences (a rank's share of batch {batch} over {})", over.join(","));
            }
            return Err(error);
        }
    }
    Ok(())
}

/// Whether the graph has routed experts (a weight with an `experts` dim).
pub(crate) fn has_experts(graph: &pleat_ir::Graph) -> bool {
    graph.params().into_iter().any(|(value, _)| graph.value(value).ty.shape.position(DimName::Experts).is_some())
}

/// Places each layer's routed experts over `axis`. Over `ep` the batch splits too (the dense layers
/// are data parallel over it); over `tsp` the tokens are already split on seq by `fold-tsp`.
fn seed_expert_parallel(module: &mut Module, axis: AxisName, degree: u64, all_to_all: bool) -> Result<()> {
    let graph = &mut module.graph;
    let experts: Vec<_> = graph
        .params()
        .into_iter()
        .filter_map(|(value, name)| {
            // The experts' projections; the router stays whole (every rank routes over all experts).
            let shape = &graph.value(value).ty.shape;
            shape.position(DimName::Ffn)?;
            Some((value, name.to_string(), shape.position(DimName::Experts)?, shape.size_of(DimName::Experts)?))
        })
        .collect();
    if experts.is_empty() {
        return Err(Error::NoExperts { model: module.name.clone() });
    }
    if let Some((_, name, _, count)) = experts.iter().find(|expert| expert.3 % degree != 0) {
        return Err(indivisible(name, DimName::Experts, *count, axis, degree));
    }
    if axis == AxisName::Ep {
        check_batch_split(module, AxisName::Ep, degree)?;
    }
    let graph = &mut module.graph;
    for (value, _, position, _) in experts {
        let axes = &mut graph.value_mut(value).spec.dims[position];
        if !axes.contains(&axis) {
            axes.push(axis);
        }
    }
    let batch_values = if axis == AxisName::Ep { token_values(graph) } else { Vec::new() };
    for value in batch_values {
        let axes = &mut graph.value_mut(value).spec.dims[0];
        if !axes.contains(&AxisName::Ep) {
            axes.push(AxisName::Ep);
        }
    }
    // The all-to-all dispatcher: each mixture sends its rows to their experts' ranks over `axis`.
    if all_to_all {
        let nodes: Vec<_> = graph.order().to_vec();
        for node in nodes {
            if let Op::MoeMlp { dispatch, .. } = &mut graph.node_mut(node).op {
                *dispatch = Some(axis);
            }
        }
    }
    Ok(())
}
