//! The largest of any range of a fixed sequence in constant time (a sparse table): the overlap
//! scheduler asks, for every candidate at every step, the most bytes the lowered order holds
//! between where it has got to and the candidate's own place.

use std::ops::Range;

/// A sparse table over a sequence of `u64`: `levels[k][i]` is the largest of `values[i..i + 2^k]`.
pub(crate) struct RangeMax {
    levels: Vec<Vec<u64>>,
}

impl RangeMax {
    pub(crate) fn new(values: &[u64]) -> RangeMax {
        let mut levels = vec![values.to_vec()];
        let mut width = 1;
        while 2 * width <= values.len() {
            let previous = levels.last().expect("level 0 exists");
            let next = (0..=values.len() - 2 * width).map(|i| previous[i].max(previous[i + width])).collect();
            levels.push(next);
            width *= 2;
        }
        RangeMax { levels }
    }

    /// The largest value in `range`, or 0 for an empty one.
    pub(crate) fn max(&self, range: Range<usize>) -> u64 {
        if range.is_empty() {
            return 0;
        }
        let level = (usize::BITS - 1 - range.len().leading_zeros()) as usize;
        let width = 1 << level;
        self.levels[level][range.start].max(self.levels[level][range.end - width])
    }
}

#[cfg(test)]
mod tests {
    use super::RangeMax;

    #[test]
    fn every_range_matches_a_scan() {
        let values: Vec<u64> = (0..37u64).map(|i| (i * 7919) % 101).collect();
        let table = RangeMax::new(&values);
        for start in 0..=values.len() {
            for end in start..=values.len() {
                let scanned = values[start..end].iter().copied().max().unwrap_or(0);
                assert_eq!(table.max(start..end), scanned, "{start}..{end}");
            }
        }
    }
}
