//! The e-class analysis: every e-class of tensors carries its type, layout and local bytes.
//!
//! A class's data is derived from any of its e-nodes with the verifier's type inference
//! (`verify::infer_type`) and the sharding rules (`sharding::output_spec`), so it is exactly what
//! the IR would say of the value. All e-nodes of a class denote the same global tensor, so they
//! must agree on type and layout: a merge of two classes that disagree means a rule is unsound.
//! It is not a panic: the analysis records it (`LayerAnalysis::conflicts`) and the pass reports
//! it as an error. Rules check the type of what they build before they add it
//! (`rules::WellTyped`), so a conflict is a bug in a rule's typing, not an expected outcome.

use egg::{Analysis, DidMerge, EGraph, Id, Language};
use pleat_ir::entity::EntityRef;
use pleat_ir::{AxisName, DimName, Mesh, NodeData, Op, ShardSpec, TensorType, ValueId};

use super::language::{classify_symbol, to_op, ChildKind, LayerLang, Leaf, LeafTable};
use crate::sharding::{output_spec, spec_text};
use crate::verify::infer_type;

/// A layer's e-graph.
pub type LayerGraph = EGraph<LayerLang, LayerAnalysis>;

/// A tensor class's facts.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorMeta {
    /// Element type and global shape.
    pub ty: TensorType,
    /// Layout over the mesh.
    pub spec: ShardSpec,
    /// Bytes one rank holds.
    pub local_bytes: u64,
}

/// What an e-class is.
#[derive(Clone, Debug, PartialEq)]
pub enum Meta {
    /// A mesh axis symbol.
    Axis(AxisName),
    /// A dim symbol.
    Dim(DimName),
    /// An attribute symbol standing for this op.
    Attribute(Op),
    /// A tensor.
    Tensor(TensorMeta),
    /// Nothing well-typed: why.
    Invalid(String),
}

impl Meta {
    /// The tensor facts, if this is a well-typed tensor.
    pub fn tensor(&self) -> Option<&TensorMeta> {
        match self {
            Meta::Tensor(tensor) => Some(tensor),
            _ => None,
        }
    }
    fn kind(&self) -> ChildKind {
        match self {
            Meta::Axis(axis) => ChildKind::Axis(*axis),
            Meta::Dim(dim) => ChildKind::Dim(*dim),
            Meta::Attribute(op) => ChildKind::Attribute(op.clone()),
            Meta::Tensor(_) => ChildKind::Tensor,
            Meta::Invalid(_) => ChildKind::Other,
        }
    }
}

/// Two classes that were merged while they disagree on type or layout.
#[derive(Clone, Debug, PartialEq)]
pub struct MergeConflict {
    /// One side, in words.
    pub left: String,
    /// The other side, in words.
    pub right: String,
}

/// The analysis: the mesh and leaf table every class's facts are derived from, and the conflicts
/// merges have met.
#[derive(Clone, Debug)]
pub struct LayerAnalysis {
    /// The mesh the specs refer to.
    pub mesh: Mesh,
    /// The layer's leaves.
    pub leaves: LeafTable,
    /// Merges of disagreeing classes, in the order they happened.
    pub conflicts: Vec<MergeConflict>,
}

impl LayerAnalysis {
    /// An analysis over `mesh` with `leaves`.
    pub fn new(mesh: Mesh, leaves: LeafTable) -> LayerAnalysis {
        LayerAnalysis { mesh, leaves, conflicts: Vec::new() }
    }
}

/// The facts of `node` given its children's facts: leaves from the table, ops by type inference
/// and the sharding rule of the IR op they stand for.
pub fn node_meta<'a>(node: &LayerLang, child: impl Fn(Id) -> &'a Meta, leaves: &LeafTable, mesh: &Mesh) -> Meta {
    if let LayerLang::Symbol(symbol) = node {
        return match leaves.get(*symbol) {
            Some(Leaf::Tensor { ty, spec }) => tensor_meta(ty.clone(), spec.clone(), mesh),
            _ => match classify_symbol(*symbol, leaves) {
                ChildKind::Axis(axis) => Meta::Axis(axis),
                ChildKind::Dim(dim) => Meta::Dim(dim),
                ChildKind::Attribute(op) => Meta::Attribute(op),
                ChildKind::Tensor | ChildKind::Other => Meta::Invalid(format!("unknown symbol {symbol}")),
            },
        };
    }
    if let Some(reason) = node.children().iter().find_map(|&id| match child(id) {
        Meta::Invalid(reason) => Some(reason.clone()),
        _ => None,
    }) {
        return Meta::Invalid(reason);
    }
    let Some((op, operands)) = to_op(node, |id| child(id).kind()) else {
        return Meta::Invalid(format!("{node} has children of the wrong kinds"));
    };
    let tensors: Vec<&TensorMeta> = operands.iter().filter_map(|&id| child(id).tensor()).collect();
    let data =
        NodeData { op, inputs: vec![ValueId::new(0); operands.len()], result: ValueId::new(0), name: String::new() };
    let types: Vec<&TensorType> = tensors.iter().map(|tensor| &tensor.ty).collect();
    let ty = match infer_type(&data, &types, mesh) {
        Ok(ty) => ty,
        Err(reason) => return Meta::Invalid(format!("{}: {reason}", data.op.mnemonic())),
    };
    let specs: Vec<&ShardSpec> = tensors.iter().map(|tensor| &tensor.spec).collect();
    let shapes: Vec<&pleat_ir::Shape> = tensors.iter().map(|tensor| &tensor.ty.shape).collect();
    match output_spec(&data, &specs, &shapes, &ty.shape) {
        Ok(spec) => tensor_meta(ty, spec, mesh),
        Err(conflict) => Meta::Invalid(format!("{}: {conflict}", data.op.mnemonic())),
    }
}

fn tensor_meta(ty: TensorType, spec: ShardSpec, mesh: &Mesh) -> Meta {
    match spec.local_sizes(&ty.shape, mesh) {
        Ok(sizes) => {
            let local_bytes = sizes.iter().product::<u64>() * ty.dtype.size_bytes();
            Meta::Tensor(TensorMeta { ty, spec, local_bytes })
        }
        Err((dim, degree)) => Meta::Invalid(format!(
            "{}={} does not split over {degree} ranks",
            ty.shape.dims()[dim].name,
            ty.shape.dims()[dim].size
        )),
    }
}

/// A class's facts in words, for conflicts.
pub fn meta_text(meta: &Meta) -> String {
    match meta {
        Meta::Tensor(tensor) => format!("{} {}", tensor.ty.dtype, spec_text(&tensor.spec, &tensor.ty.shape)),
        Meta::Axis(axis) => format!("axis {axis}"),
        Meta::Dim(dim) => format!("dim {dim}"),
        Meta::Attribute(op) => format!("attributes of {}", op.mnemonic()),
        Meta::Invalid(reason) => format!("ill-typed ({reason})"),
    }
}

impl Analysis<LayerLang> for LayerAnalysis {
    type Data = Meta;

    fn make(egraph: &mut LayerGraph, enode: &LayerLang, _id: Id) -> Meta {
        let analysis = &egraph.analysis;
        node_meta(enode, |id| &egraph[id].data, &analysis.leaves, &analysis.mesh)
    }

    fn merge(&mut self, left: &mut Meta, right: Meta) -> DidMerge {
        if *left == right {
            return DidMerge(false, false);
        }
        let same_tensor = match (&*left, &right) {
            (Meta::Tensor(a), Meta::Tensor(b)) => a.ty == b.ty && a.spec == b.spec,
            _ => false,
        };
        if !same_tensor {
            self.conflicts.push(MergeConflict { left: meta_text(left), right: meta_text(&right) });
        }
        // Keep the left facts: the class's first derivation stays what the rest of the graph saw.
        DidMerge(false, true)
    }
}
