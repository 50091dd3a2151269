//! The printer: the only code that formats IR.
//!
//! Output is deterministic: the header, then one line a node in program order, the outputs, and the
//! nodes outside the program order in id order. Nothing is aligned across lines, so a change to one
//! node changes one line of a diff. The printer never panics, even on a graph whose parts disagree
//! (a broken `Graph::from_parts`): it prints what it can, for a dump that helps find the bug.

use std::fmt::Write;

use crate::entity::EntityRef;
use crate::model::config::RopeScaling;
use crate::{Graph, Module, NodeId, Op, ShardSpec, TensorType};

/// Extra lines shown under a node's line: how cost, liveness or verifier errors appear beside the IR
/// without string surgery on the printer's output.
///
/// Each line is printed as a `; ` comment, which the parser skips, so annotated text still parses to
/// the same module.
pub trait Annotate {
    /// The lines to show under `node`'s line (none for most nodes). A line break inside one starts
    /// a new comment line.
    fn notes(&self, graph: &Graph, node: NodeId) -> Vec<String>;
}

/// No annotations: the plain printer.
struct Plain;

impl Annotate for Plain {
    fn notes(&self, _graph: &Graph, _node: NodeId) -> Vec<String> {
        Vec::new()
    }
}

/// The text of `module`: the header `; module NAME mesh=MESH`, then the graph as `print_graph` shows it.
pub fn print_module(module: &Module) -> String {
    print_module_annotated(module, &Plain)
}

/// The text of `module` with `annotate`'s notes as `; ` comment lines under the nodes they describe.
pub fn print_module_annotated(module: &Module, annotate: &dyn Annotate) -> String {
    let mut out = String::new();
    let _ = writeln!(out, "; module {} mesh={}", escape(&module.name, false), module.mesh);
    write_graph(&mut out, &module.graph, annotate);
    out
}

/// The text of `graph` without a module header: one line a node in program order, `outputs(..)`,
/// and the nodes outside the program order as `detached` lines.
pub fn print_graph(graph: &Graph) -> String {
    let mut out = String::new();
    write_graph(&mut out, graph, &Plain);
    out
}

/// The line of node `node` as the printer writes it, without the line break (what an error quotes).
pub fn print_node(graph: &Graph, node: NodeId) -> String {
    let mut out = String::new();
    write_node(&mut out, graph, node);
    out
}

fn write_graph(out: &mut String, graph: &Graph, annotate: &dyn Annotate) {
    let mut in_order = vec![false; graph.node_count()];
    for &node in graph.order() {
        if let Some(seen) = in_order.get_mut(node.index()) {
            *seen = true;
        }
        write_node(out, graph, node);
        out.push('\n');
        if graph.has_node(node) {
            for note in annotate.notes(graph, node) {
                for line in note.split('\n') {
                    let _ = writeln!(out, "; {line}");
                }
            }
        }
    }
    out.push_str("outputs(");
    for (index, output) in graph.outputs().iter().enumerate() {
        if index > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{output}");
    }
    out.push_str(")\n");
    for (index, _) in in_order.iter().enumerate().filter(|(_, &seen)| !seen) {
        out.push_str("detached ");
        write_node(out, graph, NodeId::new(index));
        out.push('\n');
    }
}

fn write_node(out: &mut String, graph: &Graph, node: NodeId) {
    if !graph.has_node(node) {
        let _ = write!(out, "; {node} is in the program order but not in the graph");
        return;
    }
    let data = graph.node(node);
    let _ = write!(out, "{}: ", data.result);
    if graph.has_value(data.result) {
        let value = graph.value(data.result);
        write_type(out, &value.ty, &value.spec);
    } else {
        out.push_str("<no such value>");
    }
    let _ = write!(out, " = {}(", data.op.mnemonic());
    for (index, input) in data.inputs.iter().enumerate() {
        if index > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{input}");
    }
    out.push(')');
    write_attributes(out, &data.op);
    let _ = write!(out, "   # {node}");
    if !data.name.is_empty() {
        out.push(' ');
        out.push_str(&escape(&data.name, false));
    }
}

/// `f32[batch=8/dp/cp, seq=64] partial(tp)`.
fn write_type(out: &mut String, ty: &TensorType, spec: &ShardSpec) {
    let _ = write!(out, "{}[", ty.dtype);
    for (index, dim) in ty.shape.dims().iter().enumerate() {
        if index > 0 {
            out.push_str(", ");
        }
        let _ = write!(out, "{}={}", dim.name, dim.size);
        for axis in spec.dims.get(index).map_or(&[][..], Vec::as_slice) {
            let _ = write!(out, "/{axis}");
        }
    }
    out.push(']');
    if !spec.partial.is_empty() {
        out.push_str(" partial(");
        for (index, axis) in spec.partial.iter().enumerate() {
            if index > 0 {
                out.push(',');
            }
            let _ = write!(out, "{axis}");
        }
        out.push(')');
    }
}

/// The op's attributes, each as ` key=value`, in the op's fixed order.
fn write_attributes(out: &mut String, op: &Op) {
    let _ = match op {
        Op::Tokens | Op::Positions | Op::Embedding | Op::SiluMul | Op::Add => Ok(()),
        Op::Param { name } => write!(out, " name=\"{}\"", escape(name, true)),
        Op::RmsNorm { eps } => write!(out, " eps={eps}"),
        Op::MatMul { contract } => write!(out, " contract={contract}"),
        Op::Rope { rope } | Op::RopeGrad { rope } => {
            let _ = write!(out, " theta={}", rope.theta);
            match &rope.scaling {
                RopeScaling::None => Ok(()),
                RopeScaling::Llama3 {
                    factor,
                    low_freq_factor,
                    high_freq_factor,
                    original_max_position_embeddings,
                } => write!(
                    out,
                    " scaling=llama3(factor={factor},low={low_freq_factor},high={high_freq_factor},original={original_max_position_embeddings})"
                ),
            }
        }
        Op::Attention { causal } => write!(out, " causal={causal}"),
        Op::CrossEntropy | Op::CrossEntropyGrad | Op::SiluMulGradGate | Op::SigmoidScale | Op::SigmoidScaleGradGate => {
            Ok(())
        }
        Op::MatMulGradInput { contract } | Op::MatMulGradWeight { contract } => write!(out, " contract={contract}"),
        Op::RmsNormGradInput { eps } | Op::RmsNormGradWeight { eps } | Op::RmsNormGradInputAdd { eps } => {
            write!(out, " eps={eps}")
        }
        Op::Sum { terms } => write!(out, " terms={terms}"),
        Op::AttentionGradQuery { causal } | Op::AttentionGradKey { causal } | Op::AttentionGradValue { causal } => {
            write!(out, " causal={causal}")
        }
        Op::EmbeddingGrad { vocab } => write!(out, " vocab={vocab}"),
        Op::SumLeading { keep } => write!(out, " keep={keep}"),
        Op::AllReduce { axis }
        | Op::RingGatedMlp { axis }
        | Op::VocabParallelCrossEntropy { axis }
        | Op::VocabParallelCrossEntropyGrad { axis } => write!(out, " axis={axis}"),
        Op::BroadcastShard { axis, dim, root } | Op::ReduceToRoot { axis, dim, root } => {
            write!(out, " axis={axis} dim={dim} root={root}")
        }
        Op::Zigzag { parts, inverse } => write!(out, " parts={parts} inverse={inverse}"),
        Op::RingAttention { axis, causal } => write!(out, " axis={axis} causal={causal}"),
        Op::RingGatedMlpGrad { axis, wrt } => write!(out, " axis={axis} wrt={}", wrt.as_str()),
        Op::ExpertCounts { top_k, scale } => write!(out, " top_k={top_k} scale={scale}"),
        Op::RouterProbSum | Op::LoadBalancingLoss => Ok(()),
        Op::RouterProbSumGrad { wrt } => write!(out, " wrt={}", wrt.as_str()),
        Op::MoeMlp { top_k, normalize, dispatch } => {
            let _ = write!(out, " top_k={top_k} normalize={normalize}");
            dispatch.map_or(Ok(()), |axis| write!(out, " dispatch={axis}"))
        }
        Op::MoeMlpGrad { top_k, normalize, dispatch, wrt } => {
            let _ = write!(out, " top_k={top_k} normalize={normalize}");
            let _ = dispatch.map_or(Ok(()), |axis| write!(out, " dispatch={axis}"));
            write!(out, " wrt={}", wrt.as_str())
        }
        Op::ReduceScatter { axis, dim } | Op::AllGather { axis, dim } | Op::LocalSlice { axis, dim } => {
            write!(out, " axis={axis} dim={dim}")
        }
        Op::AllToAll { axis, split_dim, gather_dim } => {
            write!(out, " axis={axis} split_dim={split_dim} gather_dim={gather_dim}")
        }
    };
}

/// `text` with `\`, line breaks and (when `quoted`) `"` escaped, so it stays on one line and reads back.
pub(crate) fn escape(text: &str, quoted: bool) -> String {
    let mut escaped = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '\\' => escaped.push_str("\\\\"),
            '\n' => escaped.push_str("\\n"),
            '\r' => escaped.push_str("\\r"),
            '"' if quoted => escaped.push_str("\\\""),
            c => escaped.push(c),
        }
    }
    escaped
}
