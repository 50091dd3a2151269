//! Stage balancing: which contiguous layers each pipeline stage holds.
//!
//! [`balance`] minimizes the largest stage cost exactly, by dynamic programming over prefixes, with
//! the embedding's cost on the first stage and the LM head's and loss's on the last.
//! [`parse_pp_layers`] reads the user's override (`--pp-layers 9,8,8,7`). Both return one layer
//! range a stage, covering `0..layers` in order, each stage with at least one layer.

use std::ops::Range;

use crate::pipeline::error::{Result, ScheduleError};

/// Splits layers with costs `layer_costs` into `stages` contiguous ranges that minimize the largest
/// stage cost, where the first stage also pays `first_extra` (the embedding) and the last
/// `last_extra` (the LM head and the loss). Among optimal splits, earlier stages take as many layers
/// as they can.
pub fn balance(layer_costs: &[f64], first_extra: f64, last_extra: f64, stages: u32) -> Result<Vec<Range<u32>>> {
    if stages == 0 {
        return Err(ScheduleError::Zero { what: "stages" });
    }
    let layers = layer_costs.len();
    if layers < stages as usize {
        return Err(ScheduleError::TooFewLayers { layers, stages });
    }
    for (layer, &value) in layer_costs.iter().enumerate() {
        if !value.is_finite() || value < 0.0 {
            return Err(ScheduleError::BadLayerCost { layer, value });
        }
    }
    for (what, value) in [("first_extra", first_extra), ("last_extra", last_extra)] {
        if !value.is_finite() || value < 0.0 {
            return Err(ScheduleError::BadCost { what, value });
        }
    }
    let n_stages = stages as usize;
    let mut prefix = vec![0.0; layers + 1];
    for (layer, cost) in layer_costs.iter().enumerate() {
        prefix[layer + 1] = prefix[layer] + cost;
    }
    let stage_cost = |stage: usize, start: usize, end: usize| {
        let mut cost = prefix[end] - prefix[start];
        if stage == 0 {
            cost += first_extra;
        }
        if stage == n_stages - 1 {
            cost += last_extra;
        }
        cost
    };
    // best[k][j]: the smallest largest-stage cost of putting layers j.. on stages k.., and the end
    // of stage k's range in that split. Solving from the last stage backwards lets stage k see its
    // own extras directly.
    let mut best = vec![vec![(f64::INFINITY, 0usize); layers + 1]; n_stages + 1];
    best[n_stages][layers] = (0.0, layers);
    for stage in (0..n_stages).rev() {
        let stages_after = n_stages - stage - 1;
        let later = best[stage + 1].clone();
        for (start, slot) in best[stage].iter_mut().enumerate().take(layers) {
            // Each later stage needs at least one layer.
            let last_end = layers - stages_after;
            let mut choice = (f64::INFINITY, 0usize);
            for (end, &(rest, _)) in later.iter().enumerate().take(last_end + 1).skip(start + 1) {
                let largest = stage_cost(stage, start, end).max(rest);
                // `<=` prefers the longest range among ties: earlier stages take more layers.
                if largest <= choice.0 {
                    choice = (largest, end);
                }
            }
            *slot = choice;
        }
    }
    let mut ranges = Vec::with_capacity(n_stages);
    let mut start = 0;
    for row in best.iter().take(n_stages) {
        let end = row[start].1;
        ranges.push(start as u32..end as u32);
        start = end;
    }
    Ok(ranges)
}

/// Reads `--pp-layers` (`"9,8,8,7"`: layers a stage) into one range a stage, checking that there
/// is one positive count a stage and that they sum to `total_layers`.
pub fn parse_pp_layers(text: &str, total_layers: u32, stages: u32) -> Result<Vec<Range<u32>>> {
    let mut counts = Vec::new();
    for (position, entry) in text.split(',').enumerate() {
        let entry_error = || ScheduleError::PpLayersEntry {
            text: text.to_string(),
            position: position + 1,
            entry: entry.to_string(),
        };
        let count: u32 = entry.trim().parse().map_err(|_| entry_error())?;
        if count == 0 {
            return Err(entry_error());
        }
        counts.push(count);
    }
    if counts.len() != stages as usize {
        return Err(ScheduleError::PpLayersCount { text: text.to_string(), got: counts.len(), stages });
    }
    let sum: u64 = counts.iter().map(|&count| u64::from(count)).sum();
    if sum != u64::from(total_layers) {
        return Err(ScheduleError::PpLayersSum { text: text.to_string(), got: sum, total_layers });
    }
    let mut start = 0;
    Ok(counts
        .into_iter()
        .map(|count| {
            let range = start..start + count;
            start += count;
            range
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The largest stage cost of a split, computed directly.
    fn largest(costs: &[f64], first: f64, last: f64, ranges: &[Range<u32>]) -> f64 {
        let n = ranges.len();
        ranges
            .iter()
            .enumerate()
            .map(|(stage, range)| {
                let layers: f64 = costs[range.start as usize..range.end as usize].iter().sum();
                layers + if stage == 0 { first } else { 0.0 } + if stage == n - 1 { last } else { 0.0 }
            })
            .fold(0.0, f64::max)
    }

    /// Every split of `layers` into `stages` non-empty contiguous ranges.
    fn all_splits(layers: u32, stages: u32) -> Vec<Vec<Range<u32>>> {
        if stages == 1 {
            return vec![std::iter::once(0..layers).collect()];
        }
        let mut splits = Vec::new();
        for first_end in 1..=layers - (stages - 1) {
            for rest in all_splits(layers - first_end, stages - 1) {
                let mut split = Vec::with_capacity(stages as usize);
                split.push(0..first_end);
                split.extend(rest.into_iter().map(|range| range.start + first_end..range.end + first_end));
                splits.push(split);
            }
        }
        splits
    }

    #[test]
    fn balance_is_optimal_against_brute_force() {
        // A small deterministic pseudo-random generator: costs 1..=9, extras 0..=12.
        let mut state: u64 = 0x2545_f491_4f6c_dd1d;
        let mut next = |modulus: u64| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            (state % modulus) as f64
        };
        for layers in 1..=8u32 {
            for stages in 1..=layers.min(5) {
                for _ in 0..6 {
                    let costs: Vec<f64> = (0..layers).map(|_| 1.0 + next(9)).collect();
                    let (first, last) = (next(13), next(13));
                    let got = balance(&costs, first, last, stages).unwrap();
                    assert_eq!(got.len(), stages as usize);
                    assert_eq!(got.first().unwrap().start, 0);
                    assert_eq!(got.last().unwrap().end, layers);
                    assert!(got.windows(2).all(|pair| pair[0].end == pair[1].start && pair[0].start < pair[0].end));
                    let brute = all_splits(layers, stages)
                        .iter()
                        .map(|split| largest(&costs, first, last, split))
                        .fold(f64::INFINITY, f64::min);
                    assert_eq!(largest(&costs, first, last, &got), brute, "{costs:?} {first} {last} {stages}");
                }
            }
        }
    }

    #[test]
    fn balance_moves_layers_off_the_stages_with_the_embedding_and_the_head() {
        // 32 equal layers, an embedding worth 1 layer and a head worth 3 on 4 stages: 36 / 4 = 9 a
        // stage, so the first stage holds 8 layers and the last 6.
        let ranges = balance(&[1.0; 32], 1.0, 3.0, 4).unwrap();
        assert_eq!(ranges, vec![0..8, 8..17, 17..26, 26..32]);
    }

    #[test]
    fn balance_rejects_more_stages_than_layers() {
        let err = balance(&[1.0; 3], 0.0, 0.0, 4).unwrap_err();
        assert_eq!(err.to_string(), "3 layers cannot fill 4 stages with at least one layer each; use at most 3 stages");
        assert!(matches!(balance(&[1.0, -1.0], 0.0, 0.0, 1), Err(ScheduleError::BadLayerCost { layer: 1, .. })));
    }

    #[test]
    fn pp_layers_parses_and_says_what_is_expected() {
        assert_eq!(parse_pp_layers("9,8,8,7", 32, 4).unwrap(), vec![0..9, 9..17, 17..25, 25..32]);
        assert_eq!(
            parse_pp_layers("9,8,8", 32, 4).unwrap_err().to_string(),
            "--pp-layers 9,8,8: 3 entries for 4 stages; give one layer count a stage"
        );
        assert_eq!(
            parse_pp_layers("9,8,8,8", 32, 4).unwrap_err().to_string(),
            "--pp-layers 9,8,8,8: the counts sum to 33, the model has 32 layers; make them sum to 32"
        );
        assert_eq!(
            parse_pp_layers("9,x,8,7", 32, 4).unwrap_err().to_string(),
            "--pp-layers 9,x,8,7: entry 2 (\"x\") is not a positive layer count; write counts like 9,8,8,7"
        );
        assert!(matches!(parse_pp_layers("9,0,16,7", 32, 4), Err(ScheduleError::PpLayersEntry { position: 2, .. })));
    }
}
