//! The graph: nodes that each define one value, kept in a program order.
//!
//! Nodes and values live in arenas (`PrimaryMap`) and refer to one another by id. Ids follow
//! creation order, which is stable but not topological: passes insert nodes anywhere, so the
//! program order is kept separately in `order`. A graph holds data only; analyses (liveness, cost,
//! schedules) are computed from it and kept elsewhere.

use serde::{Deserialize, Serialize};

use crate::entity::{EntityRef, PrimaryMap};
use crate::{Op, ShardSpec, TensorType};

/// A node of a `Graph`. Ids follow creation order: stable, but not topological.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct NodeId(u32);
crate::entity_impl!(NodeId, "n");

/// A value (the result of one node). Ids follow creation order.
#[derive(Copy, Clone, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct ValueId(u32);
crate::entity_impl!(ValueId, "v");

/// What a node computes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct NodeData {
    /// The operation.
    pub op: Op,
    /// Its operands.
    pub inputs: Vec<ValueId>,
    /// The value it defines.
    pub result: ValueId,
    /// A readable name (`layer0.attn_norm`) that errors and dumps show.
    pub name: String,
}

/// A value's type and layout.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ValueData {
    /// Element type and global shape.
    pub ty: TensorType,
    /// How it is laid out over the mesh.
    pub spec: ShardSpec,
    /// The node defining it.
    pub def: NodeId,
}

/// A dataflow graph in a fixed program order.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Graph {
    nodes: PrimaryMap<NodeId, NodeData>,
    values: PrimaryMap<ValueId, ValueData>,
    order: Vec<NodeId>,
    outputs: Vec<ValueId>,
}

impl Graph {
    /// An empty graph.
    pub fn new() -> Graph {
        Graph::default()
    }

    fn create(&mut self, op: Op, inputs: Vec<ValueId>, ty: TensorType, spec: ShardSpec, name: &str) -> NodeId {
        // Both arenas grow together, so a node's result value is created with it.
        let node = NodeId::new(self.nodes.len());
        let result = self.values.push(ValueData { ty, spec, def: node });
        let pushed = self.nodes.push(NodeData { op, inputs, result, name: name.to_string() });
        debug_assert_eq!(pushed, node);
        node
    }

    /// Appends a node at the end of the program order; its value starts replicated.
    pub fn add(&mut self, op: Op, inputs: &[ValueId], ty: TensorType, name: &str) -> ValueId {
        let spec = ShardSpec::replicated(ty.shape.rank());
        let node = self.create(op, inputs.to_vec(), ty, spec, name);
        self.order.push(node);
        self.nodes[node].result
    }

    /// Inserts a node right after `anchor` in the program order.
    pub fn insert_after(
        &mut self,
        anchor: NodeId,
        op: Op,
        inputs: &[ValueId],
        ty: TensorType,
        spec: ShardSpec,
        name: &str,
    ) -> ValueId {
        let node = self.create(op, inputs.to_vec(), ty, spec, name);
        let position = self.order.iter().position(|&id| id == anchor).map_or(self.order.len(), |p| p + 1);
        self.order.insert(position, node);
        self.nodes[node].result
    }

    /// Moves `node` to just after `anchor` in the program order. The caller keeps definitions
    /// before uses.
    pub fn move_after(&mut self, node: NodeId, anchor: NodeId) {
        self.order.retain(|&id| id != node);
        let position = self.order.iter().position(|&id| id == anchor).map_or(self.order.len(), |p| p + 1);
        self.order.insert(position, node);
    }

    /// Makes every user of `old` except node `except` (and the graph outputs) read `new` instead.
    pub fn replace_uses(&mut self, old: ValueId, new: ValueId, except: NodeId) {
        for &node in &self.order {
            if node == except {
                continue;
            }
            for input in &mut self.nodes[node].inputs {
                if *input == old {
                    *input = new;
                }
            }
        }
        for output in &mut self.outputs {
            if *output == old {
                *output = new;
            }
        }
    }

    /// Marks `value` as a graph output.
    pub fn add_output(&mut self, value: ValueId) {
        self.outputs.push(value);
    }

    /// The node `id`.
    pub fn node(&self, id: NodeId) -> &NodeData {
        &self.nodes[id]
    }
    /// The node `id`, mutably.
    pub fn node_mut(&mut self, id: NodeId) -> &mut NodeData {
        &mut self.nodes[id]
    }
    /// The value `id`.
    pub fn value(&self, id: ValueId) -> &ValueData {
        &self.values[id]
    }
    /// The value `id`, mutably.
    pub fn value_mut(&mut self, id: ValueId) -> &mut ValueData {
        &mut self.values[id]
    }
    /// The node defining `value`.
    pub fn def(&self, value: ValueId) -> &NodeData {
        &self.nodes[self.values[value].def]
    }
    /// Whether `node` gathers a parameter (ZeRO-3's gather of the rank's shard, or over dp × ep
    /// the gather of that gather).
    pub fn gathers_param(&self, node: &NodeData) -> bool {
        if !matches!(node.op, Op::AllGather { .. }) {
            return false;
        }
        let input = self.def(node.inputs[0]);
        matches!(input.op, Op::Param { .. }) || self.gathers_param(input)
    }
    /// Whether `id` names a node of this graph.
    pub fn has_node(&self, id: NodeId) -> bool {
        self.nodes.is_valid(id)
    }
    /// Whether `id` names a value of this graph.
    pub fn has_value(&self, id: ValueId) -> bool {
        self.values.is_valid(id)
    }
    /// The nodes in program order.
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }
    /// The graph outputs.
    pub fn outputs(&self) -> &[ValueId] {
        &self.outputs
    }
    /// The number of nodes ever created (also those no longer in the order).
    pub fn node_count(&self) -> usize {
        self.nodes.len()
    }
    /// The number of values ever created.
    pub fn value_count(&self) -> usize {
        self.values.len()
    }
    /// The nodes that read `value`, in program order.
    pub fn users(&self, value: ValueId) -> Vec<NodeId> {
        self.order.iter().copied().filter(|&node| self.nodes[node].inputs.contains(&value)).collect()
    }
    /// The first value (in program order) whose node is called `name`.
    pub fn find(&self, name: &str) -> Option<ValueId> {
        self.order.iter().map(|&node| &self.nodes[node]).find(|node| node.name == name).map(|node| node.result)
    }
    /// The first node (in program order) computing a cross-entropy loss: a training graph's loss.
    pub fn loss_node(&self) -> Option<NodeId> {
        self.order.iter().copied().find(|&node| self.nodes[node].op.is_loss())
    }
    /// The parameter values in program order, with their checkpoint names.
    pub fn params(&self) -> Vec<(ValueId, &str)> {
        self.order
            .iter()
            .filter_map(|&node| match &self.nodes[node].op {
                Op::Param { name } => Some((self.nodes[node].result, name.as_str())),
                _ => None,
            })
            .collect()
    }

    /// Drops the nodes no graph output depends on and renumbers the rest in program order, so that
    /// node `n<i>` (and value `v<i>`) is the `i`-th step. Passes that replace subgraphs call it.
    pub fn compact(&mut self) {
        let mut live = vec![false; self.nodes.len()];
        let mut stack: Vec<ValueId> = self.outputs.clone();
        while let Some(value) = stack.pop() {
            let node = self.values[value].def;
            if std::mem::replace(&mut live[node.index()], true) {
                continue;
            }
            stack.extend(self.nodes[node].inputs.iter().copied());
        }
        let kept: Vec<NodeId> = self.order.iter().copied().filter(|node| live[node.index()]).collect();
        let mut renumber = vec![None; self.nodes.len()];
        for (index, &node) in kept.iter().enumerate() {
            renumber[node.index()] = Some(index);
        }
        let value_of = |value: ValueId| {
            ValueId::new(renumber[self.values[value].def.index()].expect("a live node's operands are live"))
        };
        let mut graph = Graph::default();
        for (index, &node) in kept.iter().enumerate() {
            let data = &self.nodes[node];
            let inputs = data.inputs.iter().map(|&input| value_of(input)).collect();
            let value = &self.values[data.result];
            graph.values.push(ValueData { ty: value.ty.clone(), spec: value.spec.clone(), def: NodeId::new(index) });
            graph.nodes.push(NodeData {
                op: data.op.clone(),
                inputs,
                result: ValueId::new(index),
                name: data.name.clone(),
            });
            graph.order.push(NodeId::new(index));
        }
        graph.outputs = self.outputs.iter().map(|&output| value_of(output)).collect();
        *self = graph;
    }

    /// Rebuilds a graph from its parts, as the text parser reads them. Node `i` must define value `i`
    /// (`NodeData::result`), and `order` and `outputs` may only name existing entities; the caller
    /// (the parser) checks both before calling.
    pub fn from_parts(
        nodes: Vec<NodeData>,
        values: Vec<ValueData>,
        order: Vec<NodeId>,
        outputs: Vec<ValueId>,
    ) -> Graph {
        let mut graph = Graph::default();
        for node in nodes {
            graph.nodes.push(node);
        }
        for value in values {
            graph.values.push(value);
        }
        graph.order = order;
        graph.outputs = outputs;
        graph
    }
}

/// A graph, the mesh it is laid out on, and the module's name: the unit passes work on.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Module {
    /// A name for dumps (the model's).
    pub name: String,
    /// The device mesh the specs refer to.
    pub mesh: crate::Mesh,
    /// The program.
    pub graph: Graph,
}
