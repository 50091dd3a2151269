//! One layer of a module as an expression, and the chosen form written back into every layer.
//!
//! Layers are identical up to their names (`layer{i}.*` nodes, `model.layers.{i}.*` params), so
//! the pass reads one template (`layer0`) and writes its chosen form into every layer: the layer's
//! leaves (values defined outside it: its input, its params, the positions) are found in layer `i`
//! through the same consumer and operand as in the template, and its roots (values used outside
//! it) through the same name. Nodes keep their names where the op is unchanged; new nodes are
//! named after their first operand and their op (`layer3.o_proj.reduce_scatter`), as propagation
//! names the collectives it inserts. A layer node whose op the e-graph cannot express (a mixture's
//! experts, its router statistics) is a leaf of the expression; written back, it reads the chosen
//! forms of its operands and moves after them, so that the propagated form of what it reads is
//! not kept alive beside the chosen one.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use egg::{Id, Language, RecExpr, Symbol};
use pleat_ir::{AxisName, DimName, Module, Op, ValueId};

use super::analysis::{LayerGraph, Meta};
use super::language::{push_op, to_op, ChildKind, LayerLang, LeafTable};
use crate::error::{Error, Result};

const PASS: &str = "rewrite-collectives";

/// Where a leaf of the template is in a given layer.
#[derive(Clone, Debug, PartialEq)]
enum Binding {
    /// Operand `operand` of the layer's node `{prefix}{consumer}`.
    Operand { consumer: String, operand: usize },
    /// The layer's own node `{prefix}{suffix}`, whose op the e-graph cannot express (a mixture's
    /// experts, its router statistics): a leaf of the expression, read as it is. `operands` are
    /// the expression nodes of its inputs: written back, it reads their chosen forms.
    Node { suffix: String, operands: Vec<Id> },
}

/// One layer as an expression.
#[derive(Clone, Debug)]
pub struct LayerTemplate {
    /// The layers of the module, by index, ascending.
    pub layers: Vec<u64>,
    /// The layer's ops in program order; leaves first where they are first used.
    pub expr: RecExpr<LayerLang>,
    /// The leaves' types and the attributes' ops.
    pub leaves: LeafTable,
    /// The values used outside the layer: `(name suffix, expression node)`.
    pub roots: Vec<(String, Id)>,
    /// The expression node of each of the layer's nodes, by name suffix.
    pub named: BTreeMap<String, Id>,
    bindings: Vec<(Symbol, Binding)>,
    /// `(suffix, mnemonic)` of the layer node each expression node came from.
    origins: HashMap<Id, (String, &'static str)>,
}

/// The indices `i` of the module's `layer{i}.` nodes.
fn layer_indices(module: &Module) -> Vec<u64> {
    let graph = &module.graph;
    let found: BTreeSet<u64> = graph
        .order()
        .iter()
        .filter_map(|&node| {
            let name = graph.node(node).name.strip_prefix("layer")?;
            name.split_once('.')?.0.parse().ok()
        })
        .collect();
    found.into_iter().collect()
}

/// The template of `module`'s first layer, or `None` when the module has no `layer{i}.` nodes.
pub fn layer_template(module: &Module) -> Result<Option<LayerTemplate>> {
    let layers = layer_indices(module);
    let Some(&first) = layers.first() else { return Ok(None) };
    let prefix = format!("layer{first}.");
    let graph = &module.graph;
    let mut expr = RecExpr::default();
    let mut leaves = LeafTable::new();
    let mut ids: HashMap<ValueId, Id> = HashMap::new();
    let mut bindings = Vec::new();
    let mut named = BTreeMap::new();
    let mut origins = HashMap::new();
    let in_layer = |name: &str| name.starts_with(&prefix);
    for &node in graph.order() {
        let data = graph.node(node);
        let Some(suffix) = data.name.strip_prefix(&prefix) else { continue };
        let mut operands = Vec::with_capacity(data.inputs.len());
        for (operand, &input) in data.inputs.iter().enumerate() {
            let id = match ids.get(&input) {
                Some(&id) => id,
                None => {
                    let value = graph.value(input);
                    let symbol = leaves.tensor(&graph.def(input).name, value.ty.clone(), value.spec.clone());
                    bindings.push((symbol, Binding::Operand { consumer: suffix.to_string(), operand }));
                    let id = expr.add(LayerLang::Symbol(symbol));
                    ids.insert(input, id);
                    id
                }
            };
            operands.push(id);
        }
        let value = graph.value(data.result);
        let id = match push_op(&mut expr, &mut leaves, &data.op, &operands) {
            Some(id) => id,
            None => {
                let symbol = leaves.tensor(&data.name, value.ty.clone(), value.spec.clone());
                bindings.push((symbol, Binding::Node { suffix: suffix.to_string(), operands: operands.clone() }));
                expr.add(LayerLang::Symbol(symbol))
            }
        };
        ids.insert(data.result, id);
        named.insert(suffix.to_string(), id);
        origins.insert(id, (suffix.to_string(), data.op.mnemonic()));
    }
    let mut roots = Vec::new();
    for &node in graph.order() {
        let data = graph.node(node);
        if in_layer(&data.name) {
            continue;
        }
        for input in &data.inputs {
            add_root(graph, &prefix, *input, &ids, &mut roots);
        }
    }
    for output in graph.outputs() {
        add_root(graph, &prefix, *output, &ids, &mut roots);
    }
    Ok(Some(LayerTemplate { layers, expr, leaves, roots, named, bindings, origins }))
}

fn add_root(
    graph: &pleat_ir::Graph,
    prefix: &str,
    value: ValueId,
    ids: &HashMap<ValueId, Id>,
    roots: &mut Vec<(String, Id)>,
) {
    let Some(&id) = ids.get(&value) else { return };
    let Some(suffix) = graph.def(value).name.strip_prefix(prefix) else { return };
    if roots.iter().all(|(_, root)| *root != id) {
        roots.push((suffix.to_string(), id));
    }
}

/// The residual stream kept split between layers: how `write_back` threads it.
#[derive(Clone, Copy, Debug)]
pub struct StreamSplit {
    /// The leaf standing for the layer input's shard.
    pub shard_leaf: Symbol,
    /// The e-class of the layer's output, the root the stream leaves the layer by.
    pub output: Id,
    /// The e-class of the layer output's shard (its all-gather is the layer's output).
    pub output_shard: Id,
    /// The axis and dim the stream is split over.
    pub axis: AxisName,
    /// The split dim.
    pub dim: DimName,
}

impl LayerTemplate {
    /// The leaf that is the layer's input on the residual stream (what `attn_norm` normalizes),
    /// and its expression node.
    pub fn stream_input(&self) -> Option<(Symbol, Id)> {
        let symbol = self.bindings.iter().find_map(|(symbol, binding)| match binding {
            Binding::Operand { consumer, operand: 0 } if consumer == "attn_norm" => Some(*symbol),
            _ => None,
        })?;
        let index = self.expr.as_ref().iter().position(|node| *node == LayerLang::Symbol(symbol))?;
        Some((symbol, Id::from(index)))
    }

    /// The expression nodes read by the layer's nodes the e-graph cannot express.
    pub fn opaque_operands(&self) -> impl Iterator<Item = Id> + '_ {
        self.bindings
            .iter()
            .flat_map(|(_, binding)| match binding {
                Binding::Node { operands, .. } => operands.as_slice(),
                Binding::Operand { .. } => &[],
            })
            .copied()
    }

    /// The sub-expression of the template that defines node `id`.
    pub fn sub_expr(&self, id: Id) -> RecExpr<LayerLang> {
        let mut out = RecExpr::default();
        let mut memo: HashMap<Id, Id> = HashMap::new();
        copy_into(&self.expr, id, &mut out, &mut memo);
        out
    }
    /// The `(suffix, mnemonic)` of the layer node expression node `id` came from.
    pub fn origin(&self, id: Id) -> Option<&(String, &'static str)> {
        self.origins.get(&id)
    }

    /// Writes the form `choose` picks for each class into every layer of `module`, then drops the
    /// replaced nodes. `class_of` maps template nodes to their e-classes. With `split`, each layer
    /// reads the previous layer's output shard (the first layer a scatter of its input) and
    /// writes its own output shard, gathered only for readers outside the layers.
    pub fn write_back(
        &self,
        module: &mut Module,
        egraph: &LayerGraph,
        class_of: &[Id],
        choose: &dyn Fn(Id) -> LayerLang,
        split: Option<StreamSplit>,
    ) -> Result<()> {
        // Names the template gave each class, from its original node; and for a new class whose
        // all-gather is an original class, that class's name: it is the shard of that value.
        let mut class_names: BTreeMap<Id, (String, &'static str)> = BTreeMap::new();
        for (index, &class) in class_of.iter().enumerate() {
            if let Some(origin) = self.origins.get(&Id::from(index)) {
                class_names.entry(egraph.find(class)).or_insert_with(|| origin.clone());
            }
        }
        let mut shard_names: BTreeMap<Id, String> = BTreeMap::new();
        for (&class, (suffix, _)) in &class_names {
            for node in &egraph[class].nodes {
                if let LayerLang::AllGather([_, _, shard]) = node {
                    let shard = egraph.find(*shard);
                    if !class_names.contains_key(&shard) {
                        shard_names.entry(shard).or_insert_with(|| suffix.clone());
                    }
                }
            }
        }
        // The operands' e-classes of the nodes the e-graph cannot express, by their leaves.
        let opaque: HashMap<Symbol, Vec<Id>> = self
            .bindings
            .iter()
            .filter_map(|(symbol, binding)| match binding {
                Binding::Node { operands, .. } => {
                    Some((*symbol, operands.iter().map(|&id| egraph.find(class_of[usize::from(id)])).collect()))
                }
                Binding::Operand { .. } => None,
            })
            .collect();
        // The stream's shard entering the next layer.
        let mut stream_shard: Option<ValueId> = None;
        for &layer in &self.layers {
            let prefix = format!("layer{layer}.");
            if let (Some(split), None) = (split, stream_shard) {
                stream_shard = Some(self.scatter_input(module, &prefix, split)?);
            }
            let graph = &module.graph;
            let mut bound: HashMap<Symbol, ValueId> = HashMap::new();
            if let (Some(split), Some(shard)) = (split, stream_shard) {
                bound.insert(split.shard_leaf, shard);
            }
            for (symbol, binding) in &self.bindings {
                let value = match binding {
                    Binding::Operand { consumer, operand } => graph
                        .find(&format!("{prefix}{consumer}"))
                        .and_then(|value| graph.def(value).inputs.get(*operand).copied()),
                    Binding::Node { suffix, .. } => graph.find(&format!("{prefix}{suffix}")),
                };
                let value = value.ok_or_else(|| Error::UnexpectedGraph {
                    pass: PASS,
                    node: format!("{prefix}{}", binding_name(binding)),
                })?;
                bound.insert(*symbol, value);
            }
            let mut old_roots = Vec::new();
            for (suffix, id) in &self.roots {
                let name = format!("{prefix}{suffix}");
                let value = graph.find(&name).ok_or(Error::UnexpectedGraph { pass: PASS, node: name })?;
                old_roots.push((value, egraph.find(class_of[usize::from(*id)])));
            }
            let Some(&anchor) = old_roots
                .iter()
                .map(|(value, _)| graph.value(*value).def)
                .collect::<Vec<_>>()
                .iter()
                .max_by_key(|&&node| graph.order().iter().position(|&id| id == node))
            else {
                continue;
            };
            let mut writer = Writer {
                module,
                egraph,
                choose,
                class_names: &class_names,
                shard_names: &shard_names,
                prefix,
                bound,
                opaque: &opaque,
                anchor,
                built: HashMap::new(),
                used: BTreeSet::new(),
            };
            let mut new_roots = Vec::new();
            for (&(old, class), (suffix, _)) in old_roots.iter().zip(&self.roots) {
                let hint = format!("{}{suffix}", writer.prefix);
                // The layer's output is gathered from its shard; other roots (values read outside
                // the layers, such as a mixture's router statistics) are built as they are.
                let stream = split.filter(|split| class == split.output);
                match stream {
                    Some(split) => {
                        let shard = writer.build(split.output_shard, &hint)?;
                        stream_shard = Some(shard);
                        let op = Op::AllGather { axis: split.axis, dim: split.dim };
                        new_roots.push((old, writer.insert_after_value(shard, op, old)));
                    }
                    None => new_roots.push((old, writer.build(class, &hint)?)),
                }
            }
            for (old, new) in new_roots {
                if old != new {
                    let except = module.graph.value(new).def;
                    module.graph.replace_uses(old, new, except);
                }
            }
        }
        module.graph.compact();
        Ok(())
    }
}

impl LayerTemplate {
    /// The first layer's stream input as a shard: the reduce-scatter of the pending sum it was
    /// all-reduced from, or else a local slice of it.
    fn scatter_input(&self, module: &mut Module, prefix: &str, split: StreamSplit) -> Result<ValueId> {
        let graph = &module.graph;
        let consumer = format!("{prefix}attn_norm");
        let input = graph
            .find(&consumer)
            .and_then(|value| graph.def(value).inputs.first().copied())
            .ok_or(Error::UnexpectedGraph { pass: PASS, node: consumer })?;
        let def = graph.def(input).clone();
        let (op, operand) = match def.op {
            Op::AllReduce { axis } if axis == split.axis => {
                (Op::ReduceScatter { axis: split.axis, dim: split.dim }, def.inputs[0])
            }
            _ => (Op::LocalSlice { axis: split.axis, dim: split.dim }, input),
        };
        let mut spec = graph.value(input).spec.clone();
        let dim = graph.value(input).ty.shape.position(split.dim).ok_or_else(|| Error::UnexpectedGraph {
            pass: PASS,
            node: format!("{} has no {} dim", def.name, split.dim),
        })?;
        spec.dims[dim].push(split.axis);
        let ty = graph.value(input).ty.clone();
        let name = format!("{}.{}", graph.def(operand).name, op.mnemonic());
        let anchor = graph.value(input).def;
        Ok(module.graph.insert_after(anchor, op, &[operand], ty, spec, &name))
    }
}

fn binding_name(binding: &Binding) -> &str {
    match binding {
        Binding::Operand { consumer, .. } => consumer,
        Binding::Node { suffix, .. } => suffix,
    }
}

fn copy_into(expr: &RecExpr<LayerLang>, id: Id, out: &mut RecExpr<LayerLang>, memo: &mut HashMap<Id, Id>) -> Id {
    if let Some(&done) = memo.get(&id) {
        return done;
    }
    let node = expr[id].clone().map_children(|child| copy_into(expr, child, out, memo));
    let new = out.add(node);
    memo.insert(id, new);
    new
}

/// Builds one layer's chosen form into the graph.
struct Writer<'a> {
    module: &'a mut Module,
    egraph: &'a LayerGraph,
    choose: &'a dyn Fn(Id) -> LayerLang,
    class_names: &'a BTreeMap<Id, (String, &'static str)>,
    shard_names: &'a BTreeMap<Id, String>,
    prefix: String,
    bound: HashMap<Symbol, ValueId>,
    /// The operands' e-classes of the layer's nodes the e-graph cannot express, by their leaves.
    opaque: &'a HashMap<Symbol, Vec<Id>>,
    anchor: pleat_ir::NodeId,
    built: HashMap<Id, ValueId>,
    used: BTreeSet<String>,
}

impl Writer<'_> {
    /// Builds `class` (and what it needs); `hint` names the value it is part of.
    fn build(&mut self, class: Id, hint: &str) -> Result<ValueId> {
        let class = self.egraph.find(class);
        if let Some(&value) = self.built.get(&class) {
            return Ok(value);
        }
        let node = (self.choose)(class);
        let unexpected = |what: String| Error::UnexpectedGraph { pass: PASS, node: what };
        if let LayerLang::Symbol(symbol) = &node {
            let value = *self.bound.get(symbol).ok_or_else(|| unexpected(format!("leaf {symbol}")))?;
            // A node the e-graph cannot express reads the chosen forms of its operands: built
            // first, it moves after them (otherwise it would keep the propagated form alive).
            if let Some(operands) = self.opaque.get(symbol) {
                let mut inputs = Vec::with_capacity(operands.len());
                for &operand in operands {
                    inputs.push(self.build(operand, hint)?);
                }
                let def = self.module.graph.value(value).def;
                if self.module.graph.node(def).inputs != inputs {
                    self.module.graph.node_mut(def).inputs = inputs;
                    self.module.graph.move_after(def, self.anchor);
                    self.anchor = def;
                }
            }
            self.built.insert(class, value);
            return Ok(value);
        }
        let kind = |id: Id| match &self.egraph[id].data {
            Meta::Axis(axis) => ChildKind::Axis(*axis),
            Meta::Dim(dim) => ChildKind::Dim(*dim),
            Meta::Attribute(op) => ChildKind::Attribute(op.clone()),
            Meta::Tensor(_) => ChildKind::Tensor,
            Meta::Invalid(_) => ChildKind::Other,
        };
        let (op, operands) =
            to_op(&node, kind).ok_or_else(|| unexpected(format!("{}: ill-typed choice {node}", self.prefix)))?;
        // The value this class is (or is a shard of) names what it is built from.
        let semantic = match (self.class_names.get(&class), self.shard_names.get(&class)) {
            (Some((suffix, _)), _) | (None, Some(suffix)) => format!("{}{suffix}", self.prefix),
            (None, None) => hint.to_string(),
        };
        let mut inputs = Vec::with_capacity(operands.len());
        for operand in operands {
            inputs.push(self.build(operand, &semantic)?);
        }
        let Some(meta) = self.egraph[class].data.tensor() else {
            return Err(unexpected(format!("{}: ill-typed class {class}", self.prefix)));
        };
        let name = self.name(class, &op, &inputs, &semantic);
        let graph = &mut self.module.graph;
        let value = graph.insert_after(self.anchor, op, &inputs, meta.ty.clone(), meta.spec.clone(), &name);
        self.anchor = graph.value(value).def;
        self.built.insert(class, value);
        Ok(value)
    }

    /// Inserts collective `op` on `input` (laid out like the graph's value `like`) after the
    /// anchor, named after its operand.
    fn insert_after_value(&mut self, input: ValueId, op: Op, like: ValueId) -> ValueId {
        let graph = &self.module.graph;
        let (ty, spec) = (graph.value(like).ty.clone(), graph.value(like).spec.clone());
        let name = self.unique(format!("{}.{}", graph.def(input).name, op.mnemonic()));
        let value = self.module.graph.insert_after(self.anchor, op, &[input], ty, spec, &name);
        self.anchor = self.module.graph.value(value).def;
        value
    }

    /// The template's name where the op is the original one; a shard's compute op takes the name
    /// of the value it is a shard of; a collective is named after its operand, as propagation names
    /// them (`layer0.o_proj.reduce_scatter`); anything else after the value it is part of. Names
    /// stay unique within the layer and always start with the layer's prefix.
    fn name(&mut self, class: Id, op: &Op, inputs: &[ValueId], semantic: &str) -> String {
        let operand_name = inputs
            .first()
            .map(|&input| self.module.graph.def(input).name.clone())
            .filter(|name| name.starts_with(&self.prefix));
        // An owner's block of a weight is named after the weight and the owner (`layer0.q_proj.block1`).
        let weight_block = match (op, inputs.first()) {
            (Op::BroadcastShard { root, .. }, Some(&input))
                if matches!(self.module.graph.def(input).op, Op::Param { .. }) =>
            {
                let name = &self.module.graph.def(input).name;
                let weight = name.strip_suffix(".weight").unwrap_or(name);
                weight.rsplit('.').next().map(|short| format!("{}{short}.block{root}", self.prefix))
            }
            _ => None,
        };
        let base = weight_block.unwrap_or_else(|| match (self.class_names.get(&class), self.shard_names.get(&class)) {
            (Some((suffix, mnemonic)), _) if *mnemonic == op.mnemonic() => format!("{}{suffix}", self.prefix),
            _ if op.is_communication() || matches!(op, Op::LocalSlice { .. }) => match operand_name {
                Some(name) => format!("{name}.{}", op.mnemonic()),
                None => format!("{semantic}.{}", op.mnemonic()),
            },
            (None, Some(suffix)) => format!("{}{suffix}", self.prefix),
            _ => format!("{semantic}.{}", op.mnemonic()),
        });
        self.unique(base)
    }

    /// `base`, or `base.2`, `base.3`, ...: the first not yet used in the layer, now used.
    fn unique(&mut self, base: String) -> String {
        let mut name = base.clone();
        let mut copy = 2;
        while self.used.contains(&name) {
            name = format!("{base}.{copy}");
            copy += 1;
        }
        self.used.insert(name.clone());
        name
    }
}
