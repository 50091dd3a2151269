//! Extraction that counts a shared value once: greedy DAG extraction over a layer's e-graph.
//!
//! egg's `Extractor` costs a term as a tree, so a value read by two ops is paid for twice. In a
//! layer that bias decides real choices: the Megatron MLP reads its gathered input twice (gate and
//! up projections) and would pay for the whole attention block above it twice, while the TSP ring
//! reads its input once. Here each class's best node is the one whose *set* of needed classes
//! (its own plus the union of its children's sets) costs least, each class counted once
//! (extraction-gym's "greedy DAG" extractor). A set is a map from class to that class's own
//! seconds, so the total is a sum over distinct classes.
//!
//! Guarantees: the choice is deterministic (classes and nodes are visited in a fixed order and a
//! node replaces the best only when strictly cheaper), acyclic (a node whose children need its
//! own class is never chosen), and every chosen node is well-typed (ill-typed nodes cost nothing
//! finite and are skipped).

use std::collections::BTreeMap;

use egg::{Id, Language};

use super::analysis::LayerGraph;
use super::cost::{LayerCost, LayerCostFunction};
use super::language::LayerLang;

/// A class's best node and the classes (with their own seconds) that node needs.
#[derive(Clone, Debug)]
struct Choice {
    node: LayerLang,
    needs: BTreeMap<Id, f64>,
    seconds: f64,
}

impl Choice {
    fn cost(&self) -> LayerCost {
        LayerCost { seconds: self.seconds, nodes: self.needs.len() as u64 }
    }
}

/// The best node of every class, by shared-once cost.
pub struct DagExtractor<'a> {
    egraph: &'a LayerGraph,
    best: BTreeMap<Id, Choice>,
}

impl<'a> DagExtractor<'a> {
    /// Chooses a node for every class of `egraph` that has a well-typed, acyclic one.
    pub fn new(egraph: &'a LayerGraph, cost_fn: &LayerCostFunction<'_>) -> DagExtractor<'a> {
        let mut classes: Vec<Id> = egraph.classes().map(|class| class.id).collect();
        classes.sort();
        let mut best: BTreeMap<Id, Choice> = BTreeMap::new();
        // Costs only fall, by a strictly cheaper node each time, so this reaches a fixpoint.
        let mut changed = true;
        while changed {
            changed = false;
            for &class in &classes {
                for node in &egraph[class].nodes {
                    let Some(candidate) = Self::candidate(egraph, class, node, cost_fn, &best) else { continue };
                    let better = best.get(&class).is_none_or(|current| candidate.cost() < current.cost());
                    if better {
                        best.insert(class, candidate);
                        changed = true;
                    }
                }
            }
        }
        DagExtractor { egraph, best }
    }

    /// `node` of `class` as a choice, if its children all have one and none needs `class`.
    fn candidate(
        egraph: &LayerGraph,
        class: Id,
        node: &LayerLang,
        cost_fn: &LayerCostFunction<'_>,
        best: &BTreeMap<Id, Choice>,
    ) -> Option<Choice> {
        let own = cost_fn.node_seconds(node)?;
        if !own.is_finite() {
            return None;
        }
        let mut needs: BTreeMap<Id, f64> = BTreeMap::new();
        for &child in node.children() {
            let child = egraph.find(child);
            let choice = best.get(&child)?;
            if child == class || choice.needs.contains_key(&class) {
                return None;
            }
            needs.extend(choice.needs.iter().map(|(&id, &seconds)| (id, seconds)));
        }
        needs.insert(class, own);
        let seconds = needs.values().sum();
        Some(Choice { node: node.clone(), needs, seconds })
    }

    /// The chosen node of `class`. Panics only if `class` has no well-typed node, which a class of
    /// the template (built from a verified graph) always has.
    pub fn find_best_node(&self, class: Id) -> &LayerLang {
        &self.best[&self.egraph.find(class)].node
    }

    /// The shared-once cost of `class`'s chosen sub-graph, or infinite when it has none.
    pub fn find_best_cost(&self, class: Id) -> LayerCost {
        self.best.get(&self.egraph.find(class)).map_or(LayerCost::INFINITE, Choice::cost)
    }

    /// The chosen form of `class` as an expression (shared values once).
    pub fn best_expr(&self, class: Id) -> egg::RecExpr<LayerLang> {
        let mut expr = egg::RecExpr::default();
        let mut added: BTreeMap<Id, Id> = BTreeMap::new();
        self.add_to(self.egraph.find(class), &mut expr, &mut added);
        expr
    }

    fn add_to(&self, class: Id, expr: &mut egg::RecExpr<LayerLang>, added: &mut BTreeMap<Id, Id>) -> Id {
        if let Some(&id) = added.get(&class) {
            return id;
        }
        let node = self.find_best_node(class).clone();
        let node = node.map_children(|child| self.add_to(self.egraph.find(child), expr, added));
        let id = expr.add(node);
        added.insert(class, id);
        id
    }

    /// The seconds of the union of `roots`' chosen sub-graphs, each class counted once.
    pub fn seconds_of(&self, roots: &[Id]) -> f64 {
        let mut needs: BTreeMap<Id, f64> = BTreeMap::new();
        for &root in roots {
            match self.best.get(&self.egraph.find(root)) {
                Some(choice) => needs.extend(choice.needs.iter().map(|(&id, &seconds)| (id, seconds))),
                None => return f64::INFINITY,
            }
        }
        needs.values().sum()
    }
}
