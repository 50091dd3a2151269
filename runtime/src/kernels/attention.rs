//! Flash-style scaled dot-product attention with causal masking by absolute position and grouped
//! query heads.
//!
//! For each (batch, query head) and each tile of query rows, the kernel walks the keys in tiles and
//! keeps an online softmax per row (running maximum, running sum, rescaled accumulator), so memory
//! is one tile of scores, never the `sq x sk` matrix. Both products of a tile (`Q·K^T` and `P·V`) go
//! through `gemm` on strided views of the `[batch, seq, heads, head_dim]` buffers, without copies.
//!
//! Masking compares absolute positions (`k_pos[j] <= q_pos[i]`), not indices, so sequence-sharded
//! and zigzag layouts, where a rank's positions are not contiguous or not sorted, need no special
//! case. Key tiles that no query of the current tile can see are skipped, and tiles that every query
//! sees fully are not masked at all. Runs on the calling thread.
//!
//! For ring attention the kernel can also return each row's log-sum-exp (`attention_with_lse`),
//! and `merge_attention` combines two results over disjoint key sets exactly.

use gemm::Parallelism;

use super::check_len;
use super::matmul::{gemm_strided, StridedMatrix};
use super::KernelError;

/// Query rows per tile: the rows of a tile share one pass over the keys.
const QUERY_TILE: usize = 32;
/// Keys per tile: the width of the score tile held at once.
const KEY_TILE: usize = 64;

/// Dimensions and head layout of one attention call.
///
/// `q` is `[batch, sq, hq, head_dim]`; `k` and `v` are `[batch, sk, hkv, head_dim]`. Local query head
/// `h` is global head `q_head_offset + h` and reads global kv head `(q_head_offset + h) / group`,
/// which must be one of the local kv heads `[kv_head_offset, kv_head_offset + hkv)`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionShape {
    /// Batch entries.
    pub batch: usize,
    /// Local query positions.
    pub sq: usize,
    /// Local key/value positions.
    pub sk: usize,
    /// Local query heads.
    pub hq: usize,
    /// Local key/value heads.
    pub hkv: usize,
    /// Elements per head.
    pub head_dim: usize,
    /// Global index of local query head 0.
    pub q_head_offset: usize,
    /// Global index of local kv head 0.
    pub kv_head_offset: usize,
    /// Query heads per kv head in the whole model: `q_heads_total / kv_heads_total`.
    pub group: usize,
    /// Whether query `i` sees only keys `j` with `k_pos[j] <= q_pos[i]`.
    pub causal: bool,
    /// Multiplies every score; [`AttentionShape::new`] sets `1 / sqrt(head_dim)`.
    pub scale: f32,
}

impl AttentionShape {
    /// Unsharded heads: offsets 0, `group = hq / hkv` (0, which attention rejects, when `hkv` is 0),
    /// not causal, and the default scale `1 / sqrt(head_dim)`. Adjust the public fields from there.
    pub fn new(batch: usize, sq: usize, sk: usize, hq: usize, hkv: usize, head_dim: usize) -> Self {
        AttentionShape {
            batch,
            sq,
            sk,
            hq,
            hkv,
            head_dim,
            q_head_offset: 0,
            kv_head_offset: 0,
            group: hq.checked_div(hkv).unwrap_or(0),
            causal: false,
            scale: Self::default_scale(head_dim),
        }
    }

    /// The usual score scale, `1 / sqrt(head_dim)`.
    pub fn default_scale(head_dim: usize) -> f32 {
        1.0 / (head_dim as f32).sqrt()
    }

    /// Local kv head read by local query head `query_head`, or the error saying it is elsewhere.
    pub(super) fn local_kv_head(&self, query_head: usize) -> Result<usize, KernelError> {
        let global_query_head = self.q_head_offset + query_head;
        let kv_head = global_query_head / self.group;
        kv_head.checked_sub(self.kv_head_offset).filter(|&local| local < self.hkv).ok_or(KernelError::KvHeadNotLocal {
            query_head: global_query_head,
            kv_head,
            kv_head_offset: self.kv_head_offset,
            local_kv_heads: self.hkv,
        })
    }
}

/// `out = softmax(scale · Q·K^T + mask) · V` per batch entry and query head, computed tile by tile
/// with an online softmax. A query row that sees no key gets zeros.
///
/// `q_pos` (`sq` entries) and `k_pos` (`sk` entries) are absolute positions, used only when
/// `shape.causal`; they need not be sorted. `out` has the layout of `q`.
///
/// # Errors
/// [`KernelError::LengthMismatch`] when a buffer or position list disagrees with `shape`,
/// [`KernelError::ZeroDim`] when `shape.group` is 0, and [`KernelError::KvHeadNotLocal`] when a
/// query head's kv head is not among the local ones. Nothing is written on error.
pub fn attention(
    shape: &AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
    out: &mut [f32],
) -> Result<(), KernelError> {
    attention_rows(shape, q, k, v, q_pos, k_pos, out, None)
}

/// [`attention`] that also writes each query row's log-sum-exp of its (scaled, masked) scores,
/// `lse[(b·sq + i)·hq + h] = ln Σ_j exp(scale·q·k_j)` over the keys the row sees, `-inf` for a row
/// that sees none. With it, results over disjoint key sets merge exactly ([`merge_attention`]),
/// which is what ring attention does with the key/value blocks it receives.
///
/// # Errors
/// As [`attention`], and [`KernelError::LengthMismatch`] when `lse` is not `batch·sq·hq` long.
#[allow(clippy::too_many_arguments)] // Attention's operands plus the second result.
pub fn attention_with_lse(
    shape: &AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), KernelError> {
    check_len("attention", "lse", shape.batch.saturating_mul(shape.sq).saturating_mul(shape.hq), lse.len())?;
    attention_rows(shape, q, k, v, q_pos, k_pos, out, Some(lse))
}

/// Merges two attention results of the same queries over disjoint key sets into the result over
/// their union: with `m = max(lse_a, lse_b)`, `w_a = exp(lse_a - m)`, `w_b = exp(lse_b - m)`,
/// `out = (w_a·out_a + w_b·out_b) / (w_a + w_b)` row by row (`head_dim` elements a row) and
/// `lse = m + ln(w_a + w_b)`. A row that saw no key on either side (`-inf`) stays zeros and `-inf`.
///
/// # Errors
/// [`KernelError::LengthMismatch`] when the buffers disagree with each other or with `head_dim`,
/// [`KernelError::ZeroDim`] when `head_dim` is 0.
pub fn merge_attention(
    head_dim: usize,
    (out_a, lse_a): (&[f32], &[f32]),
    (out_b, lse_b): (&[f32], &[f32]),
    out: &mut [f32],
    lse: &mut [f32],
) -> Result<(), KernelError> {
    if head_dim == 0 {
        return Err(KernelError::ZeroDim { kernel: "merge_attention", what: "head_dim" });
    }
    let rows = lse_a.len();
    check_len("merge_attention", "lse_b", rows, lse_b.len())?;
    check_len("merge_attention", "lse", rows, lse.len())?;
    check_len("merge_attention", "out_a", rows.saturating_mul(head_dim), out_a.len())?;
    check_len("merge_attention", "out_b", rows.saturating_mul(head_dim), out_b.len())?;
    check_len("merge_attention", "out", rows.saturating_mul(head_dim), out.len())?;
    for row in 0..rows {
        let (a, b) = (lse_a[row], lse_b[row]);
        let max = a.max(b);
        let span = row * head_dim..(row + 1) * head_dim;
        if max == f32::NEG_INFINITY {
            out[span].fill(0.0);
            lse[row] = f32::NEG_INFINITY;
            continue;
        }
        // exp(-inf) = 0 drops a side that saw nothing.
        let (weight_a, weight_b) = ((a - max).exp(), (b - max).exp());
        let total = weight_a + weight_b;
        let (weight_a, weight_b) = (weight_a / total, weight_b / total);
        for ((o, &x), &y) in out[span.clone()].iter_mut().zip(&out_a[span.clone()]).zip(&out_b[span]) {
            *o = weight_a * x + weight_b * y;
        }
        lse[row] = max + total.ln();
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)] // Attention's operands plus the optional second result.
fn attention_rows(
    shape: &AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
    out: &mut [f32],
    mut lse: Option<&mut [f32]>,
) -> Result<(), KernelError> {
    validate(shape, q, k, v, q_pos, k_pos, out)?;
    let AttentionShape { batch, sq, sk, hq, hkv, head_dim, causal, scale, .. } = *shape;
    if out.is_empty() {
        return Ok(());
    }
    let q_row_stride = hq * head_dim;
    let kv_row_stride = hkv * head_dim;
    // Position range of each key tile: decides skipping and masking for a whole tile at once.
    let key_tile_bounds: Vec<(u32, u32)> = k_pos.chunks(KEY_TILE).map(position_bounds).collect();
    let mut tile = TileState::new(head_dim);

    for batch_index in 0..batch {
        for query_head in 0..hq {
            let kv_head = shape.local_kv_head(query_head)?;
            let q_base = batch_index * sq * q_row_stride + query_head * head_dim;
            let kv_base = batch_index * sk * kv_row_stride + kv_head * head_dim;
            for q_start in (0..sq).step_by(QUERY_TILE) {
                let rows = QUERY_TILE.min(sq - q_start);
                let tile_q_pos = &q_pos[q_start..q_start + rows];
                let (lowest_query, highest_query) = position_bounds(tile_q_pos);
                let q_tile = StridedMatrix {
                    data: &q[q_base + q_start * q_row_stride..],
                    row_stride: q_row_stride,
                    col_stride: 1,
                };
                tile.reset(rows);
                for (k_start, &(lowest_key, highest_key)) in (0..sk).step_by(KEY_TILE).zip(&key_tile_bounds) {
                    if causal && lowest_key > highest_query {
                        continue; // No query of this tile sees any key of it.
                    }
                    let cols = KEY_TILE.min(sk - k_start);
                    let kv_offset = kv_base + k_start * kv_row_stride;
                    // K^T[dim, key] = k[key * kv_row_stride + dim].
                    let keys_transposed =
                        StridedMatrix { data: &k[kv_offset..], row_stride: 1, col_stride: kv_row_stride };
                    let values = StridedMatrix { data: &v[kv_offset..], row_stride: kv_row_stride, col_stride: 1 };
                    let mask =
                        (causal && highest_key > lowest_query).then(|| (tile_q_pos, &k_pos[k_start..k_start + cols]));
                    tile.add_key_tile(rows, cols, q_tile, keys_transposed, values, scale, mask);
                }
                for (row, &row_sum) in tile.row_sum[..rows].iter().enumerate() {
                    if let Some(lse) = lse.as_deref_mut() {
                        lse[(batch_index * sq + q_start + row) * hq + query_head] =
                            if row_sum > 0.0 { tile.row_max[row] + row_sum.ln() } else { f32::NEG_INFINITY };
                    }
                    let start = q_base + (q_start + row) * q_row_stride;
                    let out_row = &mut out[start..start + head_dim];
                    let acc_row = &tile.acc[row * head_dim..(row + 1) * head_dim];
                    if row_sum > 0.0 {
                        let inverse_sum = 1.0 / row_sum;
                        out_row.iter_mut().zip(acc_row).for_each(|(o, &a)| *o = a * inverse_sum);
                    } else {
                        out_row.fill(0.0); // The row saw no key.
                    }
                }
            }
        }
    }
    Ok(())
}

/// The online-softmax state of one tile of query rows, and the score tile it reuses.
struct TileState {
    head_dim: usize,
    /// `[QUERY_TILE, KEY_TILE]` scores, then probabilities, of the current key tile (row stride = cols).
    scores: Vec<f32>,
    /// `[QUERY_TILE, head_dim]` unnormalised output: sum of `exp(score - row_max) * v`.
    acc: Vec<f32>,
    /// Largest score seen per row (`-inf` before any visible key).
    row_max: Vec<f32>,
    /// Sum of `exp(score - row_max)` per row.
    row_sum: Vec<f32>,
}

impl TileState {
    fn new(head_dim: usize) -> Self {
        TileState {
            head_dim,
            scores: vec![0.0; QUERY_TILE * KEY_TILE],
            acc: vec![0.0; QUERY_TILE * head_dim],
            row_max: vec![f32::NEG_INFINITY; QUERY_TILE],
            row_sum: vec![0.0; QUERY_TILE],
        }
    }

    fn reset(&mut self, rows: usize) {
        self.acc[..rows * self.head_dim].fill(0.0);
        self.row_max[..rows].fill(f32::NEG_INFINITY);
        self.row_sum[..rows].fill(0.0);
    }

    /// Folds one key tile into the state: scores, optional causal mask (query and key positions),
    /// online-softmax rescaling, then `acc += P · V`.
    #[allow(clippy::too_many_arguments)] // One tile step: its extent, three operands, scale and mask.
    fn add_key_tile(
        &mut self,
        rows: usize,
        cols: usize,
        q_tile: StridedMatrix<'_>,
        keys_transposed: StridedMatrix<'_>,
        values: StridedMatrix<'_>,
        scale: f32,
        mask: Option<(&[u32], &[u32])>,
    ) {
        let head_dim = self.head_dim;
        let scores = &mut self.scores[..rows * cols];
        gemm_strided(rows, cols, head_dim, scores, cols, q_tile, keys_transposed, scale, false, Parallelism::None);
        for (row, score_row) in scores.chunks_exact_mut(cols).enumerate() {
            if let Some((query_positions, key_positions)) = mask {
                let query_position = query_positions[row];
                for (score, &key_position) in score_row.iter_mut().zip(key_positions) {
                    if key_position > query_position {
                        *score = f32::NEG_INFINITY;
                    }
                }
            }
            let tile_max = score_row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            if tile_max == f32::NEG_INFINITY {
                // Nothing visible in this tile: contribute nothing (and avoid -inf - -inf = NaN).
                score_row.fill(0.0);
                continue;
            }
            let new_max = self.row_max[row].max(tile_max);
            // exp(-inf) = 0 drops the empty history of a row's first visible tile.
            let correction = (self.row_max[row] - new_max).exp();
            if correction != 1.0 {
                self.acc[row * head_dim..(row + 1) * head_dim].iter_mut().for_each(|a| *a *= correction);
            }
            let mut tile_sum = 0.0f32;
            for score in score_row.iter_mut() {
                *score = (*score - new_max).exp();
                tile_sum += *score;
            }
            self.row_sum[row] = self.row_sum[row] * correction + tile_sum;
            self.row_max[row] = new_max;
        }
        let probabilities = StridedMatrix { data: scores, row_stride: cols, col_stride: 1 };
        gemm_strided(
            rows,
            head_dim,
            cols,
            &mut self.acc,
            head_dim,
            probabilities,
            values,
            1.0,
            true,
            Parallelism::None,
        );
    }
}

/// Smallest and largest position in a non-empty list.
fn position_bounds(positions: &[u32]) -> (u32, u32) {
    positions.iter().fold((u32::MAX, u32::MIN), |(low, high), &p| (low.min(p), high.max(p)))
}

fn validate(
    shape: &AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
    out: &[f32],
) -> Result<(), KernelError> {
    validate_operands("attention", shape, q, k, v, q_pos, k_pos)?;
    check_len("attention", "out", q.len(), out.len())
}

/// Checks attention's operands against `shape` (for `kernel`'s messages): buffer lengths, a
/// positive group, and every local query head's kv head local.
pub(super) fn validate_operands(
    kernel: &'static str,
    shape: &AttentionShape,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    q_pos: &[u32],
    k_pos: &[u32],
) -> Result<(), KernelError> {
    let elements =
        |seq: usize, heads: usize| shape.batch.saturating_mul(seq).saturating_mul(heads).saturating_mul(shape.head_dim);
    check_len(kernel, "q", elements(shape.sq, shape.hq), q.len())?;
    check_len(kernel, "k", elements(shape.sk, shape.hkv), k.len())?;
    check_len(kernel, "v", elements(shape.sk, shape.hkv), v.len())?;
    check_len(kernel, "q_pos", shape.sq, q_pos.len())?;
    check_len(kernel, "k_pos", shape.sk, k_pos.len())?;
    if shape.group == 0 {
        return Err(KernelError::ZeroDim { kernel, what: "group" });
    }
    for query_head in 0..shape.hq {
        shape.local_kv_head(query_head)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::test_util::{assert_close, values};
    use super::*;

    /// Runs attention on seeded data and compares with softmax(QK^T)V computed row by row in f64
    /// over the full score row, masking by the same position rule.
    #[track_caller]
    fn check(shape: AttentionShape, q_pos: &[u32], k_pos: &[u32]) -> Vec<f32> {
        let AttentionShape { batch, sq, sk, hq, hkv, head_dim: d, .. } = shape;
        // Spread the inputs so that softmax rows are far from uniform.
        let q: Vec<f32> = values(batch * sq * hq * d, 31).iter().map(|x| x * 3.0).collect();
        let k: Vec<f32> = values(batch * sk * hkv * d, 32).iter().map(|x| x * 3.0).collect();
        let v = values(batch * sk * hkv * d, 33);
        let mut want = vec![0.0f64; q.len()];
        for b in 0..batch {
            for h in 0..hq {
                let kv = (shape.q_head_offset + h) / shape.group - shape.kv_head_offset;
                for i in 0..sq {
                    let q_at = |c: usize| q[((b * sq + i) * hq + h) * d + c] as f64;
                    let kv_at = |t: &[f32], j: usize, c: usize| t[((b * sk + j) * hkv + kv) * d + c] as f64;
                    let visible: Vec<usize> = (0..sk).filter(|&j| !shape.causal || k_pos[j] <= q_pos[i]).collect();
                    let scores: Vec<f64> = visible
                        .iter()
                        .map(|&j| shape.scale as f64 * (0..d).map(|c| q_at(c) * kv_at(&k, j, c)).sum::<f64>())
                        .collect();
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    let weights: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                    let total: f64 = weights.iter().sum();
                    for c in 0..d {
                        let weighted: f64 = visible.iter().zip(&weights).map(|(&j, w)| w * kv_at(&v, j, c)).sum();
                        want[((b * sq + i) * hq + h) * d + c] = if visible.is_empty() { 0.0 } else { weighted / total };
                    }
                }
            }
        }
        let mut out = vec![f32::NAN; q.len()];
        attention(&shape, &q, &k, &v, q_pos, k_pos, &mut out).unwrap();
        assert_close(&out, &want, 1e-5);
        out
    }

    fn natural(count: usize) -> Vec<u32> {
        (0..count as u32).collect()
    }

    fn causal(mut shape: AttentionShape) -> AttentionShape {
        shape.causal = true;
        shape
    }

    #[test]
    fn full_attention_matches_reference() {
        check(AttentionShape::new(2, 5, 5, 2, 2, 8), &natural(5), &natural(5));
        check(AttentionShape::new(1, 70, 150, 3, 3, 16), &natural(70), &natural(150));
    }

    #[test]
    fn causal_with_natural_positions() {
        check(causal(AttentionShape::new(2, 100, 100, 4, 4, 16)), &natural(100), &natural(100));
        check(causal(AttentionShape::new(1, 1, 1, 1, 1, 4)), &[0], &[0]);
    }

    #[test]
    fn causal_with_zigzag_positions() {
        // Zigzag over 2 ranks of a 192-token sequence split in 4 chunks of 48: this rank holds
        // chunks 0 and 3, and its keys (after an all-gather) arrive in rank order 0, 3, 1, 2.
        let chunk = |index: u32| (index * 48..(index + 1) * 48).collect::<Vec<u32>>();
        let local: Vec<u32> = [chunk(0), chunk(3)].concat();
        let gathered: Vec<u32> = [chunk(0), chunk(3), chunk(1), chunk(2)].concat();
        check(causal(AttentionShape::new(1, 96, 192, 2, 2, 8)), &local, &gathered);
        // Queries and keys both in a scrambled order, not merely in blocks.
        let scrambled: Vec<u32> = (0..80u32).map(|i| (i * 37) % 80).collect();
        check(causal(AttentionShape::new(2, 80, 80, 1, 1, 8)), &scrambled, &scrambled);
    }

    #[test]
    fn grouped_query_heads_with_offsets() {
        // 8 query heads and 4 kv heads in the model (group 2); this rank holds query heads 4..8.
        let mut sharded = causal(AttentionShape::new(2, 40, 40, 4, 2, 8));
        (sharded.group, sharded.q_head_offset, sharded.kv_head_offset) = (2, 4, 2);
        check(sharded, &natural(40), &natural(40));
        // The same query heads with every kv head replicated locally.
        let mut replicated = AttentionShape::new(1, 9, 9, 4, 4, 8);
        (replicated.group, replicated.q_head_offset) = (2, 4);
        check(replicated, &natural(9), &natural(9));
        // Multi-query attention: one kv head for all.
        check(causal(AttentionShape::new(1, 33, 33, 6, 1, 4)), &natural(33), &natural(33));
    }

    #[test]
    fn fewer_queries_than_keys() {
        // Decoding the last 3 positions against a 70-key cache.
        check(causal(AttentionShape::new(1, 3, 70, 2, 1, 16)), &[67, 68, 69], &natural(70));
        check(causal(AttentionShape::new(1, 40, 7, 2, 2, 8)), &natural(40), &natural(7));
    }

    #[test]
    fn row_with_no_visible_key_is_zero() {
        let k_pos: Vec<u32> = (10..80).collect();
        let out = check(causal(AttentionShape::new(1, 3, 70, 1, 1, 4)), &[5, 15, 90], &k_pos);
        assert_eq!(&out[..4], &[0.0; 4]);
    }

    #[test]
    fn explicit_scale_is_used() {
        let mut shape = causal(AttentionShape::new(1, 20, 20, 2, 2, 8));
        shape.scale = 0.9;
        check(shape, &natural(20), &natural(20));
    }

    #[test]
    fn kv_head_held_elsewhere_is_an_error() {
        let mut shape = AttentionShape::new(1, 1, 1, 2, 1, 2);
        (shape.group, shape.q_head_offset, shape.kv_head_offset) = (2, 2, 0);
        let mut out = [0.0; 4];
        let error = attention(&shape, &[0.0; 4], &[0.0; 2], &[0.0; 2], &[0], &[0], &mut out).unwrap_err();
        assert_eq!(
            error.to_string(),
            "attention: query head 2 needs kv head 1, but this rank holds kv heads [0, 0 + 1); \
             shard query and kv heads together"
        );
        let shape = AttentionShape::new(1, 2, 1, 1, 1, 2);
        let error = attention(&shape, &[0.0; 4], &[0.0; 2], &[0.0; 2], &[0], &[0], &mut out).unwrap_err();
        assert_eq!(error, KernelError::LengthMismatch { kernel: "attention", tensor: "q_pos", expected: 2, got: 1 });
        let mut shape = AttentionShape::new(1, 1, 1, 1, 1, 2);
        shape.group = 0;
        let error = attention(&shape, &[0.0; 2], &[0.0; 2], &[0.0; 2], &[0], &[0], &mut out[..2]).unwrap_err();
        assert_eq!(error, KernelError::ZeroDim { kernel: "attention", what: "group" });
    }

    /// The log-sum-exp of each row's visible scaled scores, in f64, straight from the definition.
    fn naive_lse(shape: &AttentionShape, q: &[f32], k: &[f32], q_pos: &[u32], k_pos: &[u32]) -> Vec<f64> {
        let AttentionShape { batch, sq, sk, hq, hkv, head_dim: d, .. } = *shape;
        let mut lse = Vec::new();
        for b in 0..batch {
            for i in 0..sq {
                for h in 0..hq {
                    let kv = (shape.q_head_offset + h) / shape.group - shape.kv_head_offset;
                    let scores: Vec<f64> = (0..sk)
                        .filter(|&j| !shape.causal || k_pos[j] <= q_pos[i])
                        .map(|j| {
                            let dot: f64 = (0..d)
                                .map(|c| {
                                    q[((b * sq + i) * hq + h) * d + c] as f64
                                        * k[((b * sk + j) * hkv + kv) * d + c] as f64
                                })
                                .sum();
                            shape.scale as f64 * dot
                        })
                        .collect();
                    lse.push(scores.iter().map(|s| s.exp()).sum::<f64>().ln());
                }
            }
        }
        lse
    }

    /// Keys `keep` of a `[batch, sk, hkv, d]` tensor, in order.
    fn keys_of(data: &[f32], batch: usize, sk: usize, width: usize, keep: &[usize]) -> Vec<f32> {
        (0..batch)
            .flat_map(|b| keep.iter().flat_map(move |&j| data[(b * sk + j) * width..(b * sk + j + 1) * width].to_vec()))
            .collect()
    }

    #[test]
    fn log_sum_exp_matches_reference() {
        let mut shape = causal(AttentionShape::new(2, 40, 70, 4, 2, 8));
        (shape.group, shape.q_head_offset, shape.kv_head_offset) = (2, 4, 2);
        let (q_pos, k_pos): (Vec<u32>, Vec<u32>) = ((30..70).collect(), (0..70).rev().collect());
        let q: Vec<f32> = values(2 * 40 * 4 * 8, 41).iter().map(|x| x * 3.0).collect();
        let k: Vec<f32> = values(2 * 70 * 2 * 8, 42).iter().map(|x| x * 3.0).collect();
        let v = values(2 * 70 * 2 * 8, 43);
        let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; 2 * 40 * 4]);
        attention_with_lse(&shape, &q, &k, &v, &q_pos, &k_pos, &mut out, &mut lse).unwrap();
        assert_close(&lse, &naive_lse(&shape, &q, &k, &q_pos, &k_pos), 1e-5);
        let mut plain = vec![0.0; q.len()];
        attention(&shape, &q, &k, &v, &q_pos, &k_pos, &mut plain).unwrap();
        assert_eq!(out, plain, "the second result leaves the first unchanged");
        let error = attention_with_lse(&shape, &q, &k, &v, &q_pos, &k_pos, &mut out, &mut lse[1..]).unwrap_err();
        assert_eq!(error, KernelError::LengthMismatch { kernel: "attention", tensor: "lse", expected: 320, got: 319 });
    }

    #[test]
    fn merging_two_key_blocks_equals_attention_over_both() {
        // Zigzag over 2 ranks of 16 positions (chunks of 4): this rank's queries hold chunks 0 and
        // 3; the key blocks are its own (chunks 0, 3) and the other rank's (chunks 1, 2).
        let (batch, hq, hkv, d) = (2, 4, 2, 8);
        let q_pos: Vec<u32> = [0, 1, 2, 3, 12, 13, 14, 15].to_vec();
        let all_pos: Vec<u32> = [0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 8, 9, 10, 11].to_vec();
        let q: Vec<f32> = values(batch * 8 * hq * d, 51).iter().map(|x| x * 3.0).collect();
        let k: Vec<f32> = values(batch * 16 * hkv * d, 52).iter().map(|x| x * 3.0).collect();
        let v = values(batch * 16 * hkv * d, 53);
        let full = causal(AttentionShape::new(batch, 8, 16, hq, hkv, d));
        let mut want = vec![0.0; q.len()];
        attention(&full, &q, &k, &v, &q_pos, &all_pos, &mut want).unwrap();
        let want_lse = naive_lse(&full, &q, &k, &q_pos, &all_pos);
        let half = causal(AttentionShape::new(batch, 8, 8, hq, hkv, d));
        let mut parts = Vec::new();
        for keep in [(0..8).collect::<Vec<_>>(), (8..16).collect()] {
            let (block_k, block_v) = (keys_of(&k, batch, 16, hkv * d, &keep), keys_of(&v, batch, 16, hkv * d, &keep));
            let block_pos: Vec<u32> = keep.iter().map(|&j| all_pos[j]).collect();
            let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; batch * 8 * hq]);
            attention_with_lse(&half, &q, &block_k, &block_v, &q_pos, &block_pos, &mut out, &mut lse).unwrap();
            parts.push((out, lse));
        }
        let (mut out, mut lse) = (vec![0.0; q.len()], vec![0.0; batch * 8 * hq]);
        let (a, b) = (&parts[0], &parts[1]);
        merge_attention(d, (&a.0, &a.1), (&b.0, &b.1), &mut out, &mut lse).unwrap();
        assert_close(&out, &want.iter().map(|&x| x as f64).collect::<Vec<_>>(), 1e-5);
        assert_close(&lse, &want_lse, 1e-5);
        // The early queries (positions 0..4) see nothing of the other block: it merges as a no-op.
        assert!(b.1[..4 * hq].iter().all(|&x| x == f32::NEG_INFINITY));
        assert_eq!(&out[..4 * hq * d], &a.0[..4 * hq * d]);
    }

    #[test]
    fn merge_of_rows_that_saw_nothing_is_zero() {
        let inf = f32::NEG_INFINITY;
        let (mut out, mut lse) = (vec![9.0; 4], vec![0.0; 2]);
        let out_a = [1.0, 2.0, 5.0, 6.0];
        let out_b = [3.0, 4.0, 7.0, 8.0];
        merge_attention(2, (&out_a, &[inf, 0.0]), (&out_b, &[inf, 0.0]), &mut out, &mut lse).unwrap();
        assert_eq!(out, [0.0, 0.0, 6.0, 7.0]);
        assert_eq!(lse, [inf, 2.0f32.ln()]);
        let error = merge_attention(2, (&out_a, &[0.0]), (&out_b, &[0.0, 0.0]), &mut out, &mut lse).unwrap_err();
        assert_eq!(
            error,
            KernelError::LengthMismatch { kernel: "merge_attention", tensor: "lse_b", expected: 1, got: 2 }
        );
    }
}
