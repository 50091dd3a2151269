//! Dense f32 tensors, the only data the reference interpreter handles.
//!
//! A `Tensor` is a shape and its elements in row-major order. Token ids and positions travel as
//! f32 too: every integer below 2^24 is exact in f32, and the interpreter checks that bound
//! wherever it turns an element back into an index, so no id or position is ever rounded.

/// A dense f32 tensor, row-major.
///
/// The fields are public so callers can build and read tensors freely; every op checks that
/// `data.len()` equals the product of `shape` before it reads anything, and reports a mismatch as
/// an error rather than panicking.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// The size of each dim, outermost first.
    pub shape: Vec<usize>,
    /// The elements, the last dim varying fastest.
    pub data: Vec<f32>,
}

/// The exclusive bound below which every non-negative integer is exact in f32 (2^24).
pub(crate) const EXACT_INTEGER_LIMIT: u32 = 1 << 24;

impl Tensor {
    /// Rounds every element to bf16 (to nearest even, as `half` converts) when `dtype` is bf16,
    /// kept as f32: what the runtime's bf16 buffer of it holds. The runtime stores every other
    /// dtype in f32, so the others are left as they are.
    pub(crate) fn round_to(&mut self, dtype: crate::DType) {
        if dtype == crate::DType::Bf16 {
            self.data.iter_mut().for_each(|value| *value = half::bf16::from_f32(*value).to_f32());
        }
    }

    /// A tensor of `shape` holding `data`, or `None` when `data` does not have one element for each
    /// index of `shape`.
    pub fn new(shape: Vec<usize>, data: Vec<f32>) -> Option<Tensor> {
        let tensor = Tensor { shape, data };
        tensor.is_consistent().then_some(tensor)
    }

    /// A tensor of `shape` filled with zeros.
    pub fn zeros(shape: Vec<usize>) -> Tensor {
        let numel = element_count(&shape);
        Tensor { shape, data: vec![0.0; numel] }
    }

    /// The number of dims.
    pub fn rank(&self) -> usize {
        self.shape.len()
    }

    /// The number of elements the shape calls for (saturating at `usize::MAX`, so an absurd shape
    /// reads as inconsistent instead of overflowing).
    pub fn numel(&self) -> usize {
        element_count(&self.shape)
    }

    /// Whether `data` holds exactly one element for each index of `shape`.
    pub fn is_consistent(&self) -> bool {
        self.data.len() == self.numel()
    }

    /// The largest elementwise difference `|self - other|` and the flat index where it occurs, or
    /// `None` when the shapes differ. A NaN on either side counts as an infinite difference, so
    /// comparisons cannot pass by accident. Two empty tensors differ by 0 at index 0.
    pub fn max_abs_diff(&self, other: &Tensor) -> Option<(usize, f32)> {
        if self.shape != other.shape || self.data.len() != other.data.len() {
            return None;
        }
        let mut worst = (0, 0.0_f32);
        for (index, (&left, &right)) in self.data.iter().zip(&other.data).enumerate() {
            let difference = if left.is_nan() || right.is_nan() { f32::INFINITY } else { (left - right).abs() };
            if difference > worst.1 {
                worst = (index, difference);
            }
        }
        Some(worst)
    }

    /// The multi-index of flat index `flat` in this tensor's shape.
    pub fn unravel(&self, flat: usize) -> Vec<usize> {
        unravel(&self.shape, flat)
    }
}

/// The product of `shape`, saturating instead of overflowing.
pub(crate) fn element_count(shape: &[usize]) -> usize {
    shape.iter().fold(1_usize, |count, &size| count.saturating_mul(size))
}

/// The multi-index of flat index `flat` in row-major `shape`.
pub(crate) fn unravel(shape: &[usize], mut flat: usize) -> Vec<usize> {
    let mut index = vec![0; shape.len()];
    for (slot, &size) in index.iter_mut().zip(shape).rev() {
        if size > 0 {
            *slot = flat % size;
            flat /= size;
        }
    }
    index
}

/// The integer an element stands for, when it is an exact integer in `0..2^24`.
pub(crate) fn exact_index(value: f32) -> Option<usize> {
    let exact = value >= 0.0 && value.fract() == 0.0 && value < EXACT_INTEGER_LIMIT as f32;
    // The cast is exact: the value is a whole number below 2^24.
    exact.then_some(value as usize)
}

/// Test helper: asserts that `actual` has `expected`'s shape and is within `tolerance` of it
/// (absolute, plus the same amount relative to `expected`), naming the worst element on failure.
#[cfg(test)]
#[track_caller]
pub(crate) fn assert_close(actual: &Tensor, expected: &Tensor, tolerance: f32) {
    assert_eq!(actual.shape, expected.shape, "shapes differ");
    assert!(actual.is_consistent() && expected.is_consistent(), "inconsistent tensor");
    for (index, (&got, &want)) in actual.data.iter().zip(&expected.data).enumerate() {
        let allowed = tolerance * (1.0 + want.abs());
        assert!(
            (got - want).abs() <= allowed,
            "element {:?} (flat {index}): got {got}, expected {want}, allowed difference {allowed}",
            actual.unravel(index)
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn construction_checks_the_element_count() {
        assert!(Tensor::new(vec![2, 3], vec![0.0; 6]).is_some());
        assert!(Tensor::new(vec![2, 3], vec![0.0; 5]).is_none());
        assert_eq!(Tensor::zeros(vec![]).data, vec![0.0]);
        assert_eq!(Tensor::zeros(vec![3, 0]).numel(), 0);
        let absurd = Tensor { shape: vec![usize::MAX, 2], data: vec![] };
        assert!(!absurd.is_consistent());
    }

    #[test]
    fn unravel_is_row_major() {
        assert_eq!(unravel(&[2, 3, 4], 0), vec![0, 0, 0]);
        // 17 = 1*12 + 1*4 + 1.
        assert_eq!(unravel(&[2, 3, 4], 17), vec![1, 1, 1]);
        assert_eq!(unravel(&[2, 3, 4], 23), vec![1, 2, 3]);
    }

    #[test]
    fn exact_indices_are_whole_numbers_below_two_to_the_24() {
        assert_eq!(exact_index(0.0), Some(0));
        assert_eq!(exact_index(16_777_215.0), Some(16_777_215));
        assert_eq!(exact_index(16_777_216.0), None);
        assert_eq!(exact_index(2.5), None);
        assert_eq!(exact_index(-1.0), None);
        assert_eq!(exact_index(f32::NAN), None);
    }

    #[test]
    fn max_abs_diff_names_the_worst_element_and_counts_nan() {
        let left = Tensor::new(vec![3], vec![1.0, 2.0, 3.0]).unwrap();
        let right = Tensor::new(vec![3], vec![1.0, 2.5, 2.9]).unwrap();
        assert_eq!(left.max_abs_diff(&right), Some((1, 0.5)));
        let nan = Tensor::new(vec![3], vec![1.0, 2.0, f32::NAN]).unwrap();
        assert_eq!(left.max_abs_diff(&nan), Some((2, f32::INFINITY)));
        assert_eq!(left.max_abs_diff(&Tensor::zeros(vec![1, 3])), None);
    }
}
