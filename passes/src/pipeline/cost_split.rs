//! The default stage split: [`balance`](super::balance()) fed by the cost model.
//!
//! Every transformer layer costs one micro-batch's training step on it (forward, backward and any
//! recompute, `cost::compute::layer_time`); the first stage also pays the embedding (a gather
//! forward, a scatter-add backward, both memory-bound) and the last one the final norm, the LM
//! head and the loss (`cost::compute::head_time`). A model with a large vocabulary therefore
//! gets fewer layers on its last stage. Guarantee: the same contiguous, non-empty ranges
//! `balance` returns, or its error.

use std::ops::Range;

use crate::cost::activation::local_tokens;
use crate::cost::compute::{head_time, layer_time};
use crate::cost::{HardwareSpec, Layout, ModelShape, Workload};
use crate::pipeline::balance::balance;
use crate::pipeline::error::Result;

/// Seconds of one micro-batch's training step on each part of the model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PartCosts {
    /// One transformer layer.
    pub layer: f64,
    /// The embedding, on the first stage.
    pub embedding: f64,
    /// The final norm, LM head and loss, on the last stage.
    pub head: f64,
}

/// The cost of each part of `model` on one rank of `layout` (the mesh inside a stage) for
/// `workload`'s micro-batch on `hw`.
pub fn part_costs(model: &ModelShape, layout: &Layout, workload: &Workload, hw: &HardwareSpec) -> PartCosts {
    // The gather reads and writes a row a token; the backward's scatter-add reads the gradient
    // and reads and writes the table's rows: about three passes over tokens × hidden.
    let row_bytes = (model.hidden * model.dtype_bytes) as f64;
    let embedding = 5.0 * local_tokens(layout, workload) * row_bytes / hw.hbm_bytes_per_s;
    PartCosts {
        layer: layer_time(model, layout, workload, hw),
        embedding,
        head: head_time(model, layout, workload, hw),
    }
}

/// Each stage's layers, balanced by `costs`: `model.layers` layers in `stages` contiguous runs.
pub fn cost_balanced_layers(model: &ModelShape, costs: &PartCosts, stages: u32) -> Result<Vec<Range<u32>>> {
    let layer_costs = vec![costs.layer; model.layers as usize];
    balance(&layer_costs, costs.embedding, costs.head, stages)
}

#[cfg(test)]
mod tests {
    use pleat_ir::model::preset::preset;
    use pleat_ir::AxisName;

    use super::*;

    fn layers_a_stage(vocab: u64, stages: u32) -> Vec<u32> {
        let mut config = preset("tiny").expect("tiny");
        config.num_layers = 8;
        config.vocab_size = vocab;
        let model = ModelShape::from_config(&config);
        let layout = Layout::new(&[(AxisName::Tp, 1)], false);
        let hw = HardwareSpec::builtin("h100-sxm").expect("builtin");
        let costs = part_costs(&model, &layout, &Workload::training(64, 2), &hw);
        let ranges = cost_balanced_layers(&model, &costs, stages).expect("balances");
        ranges.iter().map(|range| range.end - range.start).collect()
    }

    #[test]
    fn a_heavy_head_leaves_the_last_stage_fewer_layers() {
        // tiny's own vocabulary (256) is light beside a layer: an even split.
        assert_eq!(layers_a_stage(256, 2), vec![4, 4]);
        // With 64K entries the head outweighs layers, so the last stage gives up layers.
        let heavy = layers_a_stage(65_536, 2);
        assert_eq!(heavy.iter().sum::<u32>(), 8);
        assert!(heavy[1] < heavy[0], "{heavy:?}");
    }

    #[test]
    fn the_split_minimizes_the_largest_stage() {
        // Checked against every two-stage split, computed naively.
        let mut config = preset("tiny").expect("tiny");
        config.num_layers = 8;
        config.vocab_size = 65_536;
        let model = ModelShape::from_config(&config);
        let layout = Layout::new(&[], false);
        let hw = HardwareSpec::builtin("h100-sxm").expect("builtin");
        let costs = part_costs(&model, &layout, &Workload::training(64, 2), &hw);
        let stage_max = |first: u32| {
            let first_cost = costs.embedding + f64::from(first) * costs.layer;
            let last_cost = f64::from(8 - first) * costs.layer + costs.head;
            first_cost.max(last_cost)
        };
        let best = (1..8).map(stage_max).fold(f64::INFINITY, f64::min);
        let ranges = cost_balanced_layers(&model, &costs, 2).expect("balances");
        assert!((stage_max(ranges[0].end) - best).abs() <= 1e-12 * best, "{ranges:?}");
    }
}
