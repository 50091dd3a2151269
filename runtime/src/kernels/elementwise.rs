//! Elementwise kernels (SwiGLU's `silu(gate) * up`, residual adds) and the vocab-parallel embedding
//! lookup, which is a row copy per token.
//!
//! The loops are plain zips over equal-length slices, which the compiler vectorises; each is checked
//! against its formula in the tests.

use super::{check_len, expect_valid, KernelError};

/// `out = silu(gate) * up` elementwise, with `silu(x) = x / (1 + exp(-x))`.
///
/// # Panics
/// If the three slices differ in length.
pub fn silu_mul(gate: &[f32], up: &[f32], out: &mut [f32]) {
    expect_valid(check_len("silu_mul", "up", gate.len(), up.len()).and(check_len(
        "silu_mul",
        "out",
        gate.len(),
        out.len(),
    )));
    for ((out_value, &gate_value), &up_value) in out.iter_mut().zip(gate).zip(up) {
        *out_value = gate_value / (1.0 + (-gate_value).exp()) * up_value;
    }
}

/// `out[r, h] = sigmoid(gate[r]) * y[r, h]` over rows of `hidden`.
///
/// # Panics
/// If `y` and `out` do not hold `gate.len() * hidden` elements.
pub fn sigmoid_scale(gate: &[f32], y: &[f32], hidden: usize, out: &mut [f32]) {
    let size = gate.len() * hidden;
    expect_valid(check_len("sigmoid_scale", "y", size, y.len()).and(check_len(
        "sigmoid_scale",
        "out",
        size,
        out.len(),
    )));
    for ((out_row, y_row), &gate_value) in
        out.chunks_exact_mut(hidden.max(1)).zip(y.chunks_exact(hidden.max(1))).zip(gate)
    {
        let scale = 1.0 / (1.0 + (-gate_value).exp());
        out_row.iter_mut().zip(y_row).for_each(|(out_value, &value)| *out_value = scale * value);
    }
}

/// `out[r] = sigmoid'(gate[r]) · Σ_h dy[r, h] · y[r, h]`: the gradient of [`sigmoid_scale`] with
/// respect to `gate`.
///
/// # Panics
/// If `y` or `dy` does not hold `gate.len() * hidden` elements, or `out` not `gate.len()`.
pub fn sigmoid_scale_grad_gate(gate: &[f32], y: &[f32], dy: &[f32], hidden: usize, out: &mut [f32]) {
    let size = gate.len() * hidden;
    expect_valid(
        check_len("sigmoid_scale_grad_gate", "y", size, y.len())
            .and(check_len("sigmoid_scale_grad_gate", "dy", size, dy.len()))
            .and(check_len("sigmoid_scale_grad_gate", "out", gate.len(), out.len())),
    );
    for (row, (out_value, &gate_value)) in out.iter_mut().zip(gate).enumerate() {
        let span = row * hidden..(row + 1) * hidden;
        let inner: f32 = y[span.clone()].iter().zip(&dy[span]).map(|(a, b)| a * b).sum();
        let sigmoid = 1.0 / (1.0 + (-gate_value).exp());
        *out_value = sigmoid * (1.0 - sigmoid) * inner;
    }
}

/// `out = a + b` elementwise.
///
/// # Panics
/// If the three slices differ in length.
pub fn add(a: &[f32], b: &[f32], out: &mut [f32]) {
    expect_valid(check_len("add", "b", a.len(), b.len()).and(check_len("add", "out", a.len(), out.len())));
    for ((out_value, &a_value), &b_value) in out.iter_mut().zip(a).zip(b) {
        *out_value = a_value + b_value;
    }
}

/// `acc += b` elementwise.
///
/// # Panics
/// If the slices differ in length.
pub fn add_in_place(acc: &mut [f32], b: &[f32]) {
    expect_valid(check_len("add_in_place", "b", acc.len(), b.len()));
    for (acc_value, &b_value) in acc.iter_mut().zip(b) {
        *acc_value += b_value;
    }
}

/// Refuses the first token id `>= vocab_total`: what every embedding lookup and its gradient check
/// before writing anything, and what a device runtime checks before it launches one.
///
/// # Errors
/// [`KernelError::TokenOutOfRange`], naming the token's position and id.
pub fn check_token_ids(tokens: &[u32], vocab_total: usize) -> Result<(), KernelError> {
    match tokens.iter().enumerate().find(|&(_, &token)| token as usize >= vocab_total) {
        Some((position, &token)) => Err(KernelError::TokenOutOfRange { position, token, vocab_size: vocab_total }),
        None => Ok(()),
    }
}

/// Vocab-parallel embedding lookup (Megatron's `VocabParallelEmbedding`).
///
/// `table` holds rows `[vocab_offset, vocab_offset + table.len() / hidden)` of the global
/// `[vocab_total, hidden]` table. Row `t` of `out` (`[tokens.len(), hidden]`) receives the token's
/// row when this shard holds it and zeros otherwise, so summing `out` over the shards (the caller's
/// all-reduce) gives the full lookup. Everything is checked before `out` is written, so on error
/// `out` is untouched.
///
/// # Errors
/// [`KernelError::TokenOutOfRange`] for a token id `>= vocab_total`; [`KernelError::ShardOutOfRange`]
/// when the shard reaches past `vocab_total`; [`KernelError::ZeroDim`], [`KernelError::NotDivisible`]
/// or [`KernelError::LengthMismatch`] when `hidden`, `table` and `out` disagree.
pub fn embedding(
    table: &[f32],
    hidden: usize,
    vocab_offset: usize,
    vocab_total: usize,
    tokens: &[u32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    if hidden == 0 {
        return Err(KernelError::ZeroDim { kernel: "embedding", what: "hidden" });
    }
    if table.len() % hidden != 0 {
        return Err(KernelError::NotDivisible {
            kernel: "embedding",
            what: "table length",
            count: table.len(),
            divisor: hidden,
        });
    }
    let rows = table.len() / hidden;
    if vocab_offset.saturating_add(rows) > vocab_total {
        return Err(KernelError::ShardOutOfRange { vocab_offset, rows, vocab_size: vocab_total });
    }
    check_len("embedding", "out", tokens.len().saturating_mul(hidden), out.len())?;
    check_token_ids(tokens, vocab_total)?;
    for (&token, out_row) in tokens.iter().zip(out.chunks_exact_mut(hidden)) {
        match (token as usize).checked_sub(vocab_offset).filter(|&local_row| local_row < rows) {
            Some(local_row) => {
                out_row.copy_from_slice(&table[local_row * hidden..(local_row + 1) * hidden]);
            }
            None => out_row.fill(0.0),
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::*;

    /// Runs the three arithmetic kernels on seeded data against their formulas in f64.
    #[track_caller]
    fn check_arithmetic(count: usize) {
        let a = values(count, 21).iter().map(|v| v * 12.0).collect::<Vec<_>>();
        let b = values(count, 22);
        let mut out = vec![f32::NAN; count];

        silu_mul(&a, &b, &mut out);
        let want: Vec<f64> = a.iter().zip(&b).map(|(&g, &u)| g as f64 / (1.0 + (-g as f64).exp()) * u as f64).collect();
        assert_close(&out, &want, 1e-6);

        add(&a, &b, &mut out);
        let want: Vec<f64> = a.iter().zip(&b).map(|(&x, &y)| x as f64 + y as f64).collect();
        assert_close(&out, &want, 1e-7);

        let mut acc = a.clone();
        add_in_place(&mut acc, &b);
        assert_close(&acc, &want, 1e-7);
    }

    #[test]
    fn arithmetic_matches_formulas() {
        check_arithmetic(0);
        check_arithmetic(1);
        check_arithmetic(1000);
    }

    #[test]
    fn silu_saturates_without_nan() {
        let mut out = [0.0; 3];
        silu_mul(&[-200.0, 200.0, 0.0], &[1.0, 1.0, 1.0], &mut out);
        assert_eq!(out, [0.0, 200.0, 0.0]);
    }

    /// Looks tokens up in a shard of a `[vocab, hidden]` table whose row `r` holds `r * 10 + column`,
    /// and compares with the rows (or zeros) picked by hand.
    #[track_caller]
    fn check_embedding(vocab: usize, hidden: usize, shard: std::ops::Range<usize>, tokens: &[u32]) {
        let global: Vec<f32> = (0..vocab * hidden).map(|i| ((i / hidden) * 10 + i % hidden) as f32).collect();
        let table = &global[shard.start * hidden..shard.end * hidden];
        let mut out = vec![f32::NAN; tokens.len() * hidden];
        embedding(table, hidden, shard.start, vocab, tokens, &mut out).unwrap();
        let mut want = Vec::new();
        for &token in tokens {
            let row = token as usize;
            for column in 0..hidden {
                let held = shard.contains(&row);
                want.push(if held { global[row * hidden + column] as f64 } else { 0.0 });
            }
        }
        assert_close(&out, &want, 0.0);
    }

    #[test]
    fn embedding_copies_held_rows_and_zeroes_the_rest() {
        check_embedding(8, 3, 0..8, &[0, 7, 3, 3]);
        check_embedding(8, 3, 4..8, &[0, 7, 3, 4, 5]);
        check_embedding(8, 4, 0..4, &[0, 7, 3, 4]);
        check_embedding(8, 2, 2..5, &[]);
    }

    #[test]
    fn embedding_shards_sum_to_the_full_lookup() {
        let (vocab, hidden, tokens) = (10, 4, [9u32, 0, 5, 4, 1]);
        let global = values(vocab * hidden, 23);
        let mut full = vec![0.0; tokens.len() * hidden];
        embedding(&global, hidden, 0, vocab, &tokens, &mut full).unwrap();
        let mut summed = vec![0.0f64; full.len()];
        for (start, end) in [(0, 3), (3, 6), (6, 10)] {
            let mut part = vec![0.0; full.len()];
            embedding(&global[start * hidden..end * hidden], hidden, start, vocab, &tokens, &mut part).unwrap();
            summed.iter_mut().zip(&part).for_each(|(sum, &value)| *sum += value as f64);
        }
        assert_close(&full, &summed, 0.0);
    }

    #[test]
    fn embedding_errors_name_the_problem() {
        let mut out = [0.0; 6];
        let error = embedding(&[0.0; 8], 2, 0, 4, &[1, 4, 0], &mut out).unwrap_err();
        assert_eq!(
            error.to_string(),
            "embedding: token at position 1 has id 4 but the vocabulary has 4 entries; \
             check the tokenizer matches the model"
        );
        let error = embedding(&[0.0; 8], 2, 2, 5, &[1, 4, 0], &mut out).unwrap_err();
        assert_eq!(error, KernelError::ShardOutOfRange { vocab_offset: 2, rows: 4, vocab_size: 5 });
        let error = embedding(&[0.0; 8], 2, 0, 4, &[1, 2], &mut out).unwrap_err();
        assert_eq!(error, KernelError::LengthMismatch { kernel: "embedding", tensor: "out", expected: 4, got: 6 });
    }
}
