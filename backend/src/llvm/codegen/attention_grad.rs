//! The gradients of attention on a GPU, one output row a thread, as the runtime's `attention_grad`
//! defines them: nothing of the forward is kept, so each query row's softmax is recomputed from q
//! and k. With `P = softmax(scale·q·kᵀ)` over the keys a row sees, `dP = dy·vᵀ` and
//! `mean = Σ P·dP`: `dq = scale·Σ P (dP - mean) k`, `dk = scale·Σ P (dP - mean) q`, `dv = Σ P dy`.
//!
//! q's gradient takes one query row an item: a first pass over the keys the row sees gives its
//! maximum, its sum and `Σ P·dP` (online, as the forward's running sums), a second adds each key's
//! share. k's and v's take one key row (batch entry, position, local kv head) an item: for each local
//! query head reading that kv head and each query that sees the key, that query row's statistics
//! over every key it sees, then the row's share (quadratic in the sequence a thread, where the
//! runtime's tiled kernel is quadratic in all; a GPU runs many rows at once). The key and value
//! gradients sum over the local query heads only, as the runtime's do. A query row that sees no key
//! contributes nothing; statistics are f32 (the runtime's are f64).

use inkwell::values::{FloatValue, IntValue, PointerValue};
use inkwell::{FloatPredicate, IntPredicate};

use super::{Codegen, Frame, Gen, LlvmError, Operand};
use crate::program::{AttentionDims, AttentionOperand};

/// The kernel's operands a row's statistics read (the query positions are read apart), with a
/// head's width and the softmax scale.
struct Operands<'ctx> {
    q: Operand<'ctx>,
    k: Operand<'ctx>,
    v: Operand<'ctx>,
    k_pos: Operand<'ctx>,
    dy: Operand<'ctx>,
    head_dim: u64,
    scale: FloatValue<'ctx>,
}

/// A query row's softmax statistics, in the thread's frame.
struct RowSlots<'ctx> {
    max: PointerValue<'ctx>,
    sum: PointerValue<'ctx>,
    /// `Σ e^(s - max) · dP`, rescaled as the maximum moves.
    weighted_dp: PointerValue<'ctx>,
}

/// One query row: where its q (and dy) starts, its batch entry, the local kv head it reads and
/// its position.
#[derive(Clone, Copy)]
struct QueryRow<'ctx> {
    base: IntValue<'ctx>,
    batch_index: IntValue<'ctx>,
    kv_head: IntValue<'ctx>,
    position: IntValue<'ctx>,
}

/// A row's statistics once its keys are seen: the maximum, the inverse of the sum (0 when it saw
/// none) and `Σ P·dP`.
struct Statistics<'ctx> {
    max: FloatValue<'ctx>,
    inverse_sum: FloatValue<'ctx>,
    mean_dp: FloatValue<'ctx>,
}

impl<'ctx> Codegen<'ctx, '_> {
    /// The gradient of attention with respect to `wrt` (see the module's doc).
    pub(super) fn attention_grad(&self, frame: &Frame<'ctx>, dims: &AttentionDims, wrt: AttentionOperand) -> Gen<()> {
        let [q, k, v, q_pos, k_pos, dy] = frame.inputs[..] else {
            return Err(LlvmError::Builder {
                message: format!("attention's gradient takes 6 operands, not {}", frame.inputs.len()),
            });
        };
        let AttentionDims { batch, sq, sk, hq, hkv, head_dim, causal, scale, .. } = *dims;
        let scale = self.f32_type.const_float(f64::from(scale));
        let operands = Operands { q, k, v, k_pos, dy, head_dim, scale };
        let out = frame.outs[0];
        // In the entry block, so that a GPU keeps them in the thread's frame (no dynamic alloca).
        let accumulator = self.builder.build_alloca(self.f32_type.array_type(head_dim as u32), "accumulator")?;
        let slots = RowSlots {
            max: self.builder.build_alloca(self.f32_type, "row_max")?,
            sum: self.builder.build_alloca(self.f32_type, "row_sum")?,
            weighted_dp: self.builder.build_alloca(self.f32_type, "row_weighted_dp")?,
        };
        let zero = self.f32_type.const_float(0.0);
        match wrt {
            AttentionOperand::Query => self.parallel(frame, batch * sq * hq, |row| {
                // row = (b·sq + i)·hq + h, the layout of q, dy and the result.
                let head = self.builder.build_int_unsigned_rem(row, self.index(hq), "head")?;
                let position_row = self.builder.build_int_unsigned_div(row, self.index(hq), "position_row")?;
                let query_index = self.builder.build_int_unsigned_rem(position_row, self.index(sq), "query_index")?;
                let query = QueryRow {
                    base: self.builder.build_int_mul(row, self.index(head_dim), "q_base")?,
                    batch_index: self.builder.build_int_unsigned_div(position_row, self.index(sq), "batch_index")?,
                    kv_head: self.local_kv_head(head, dims)?,
                    position: self.load_u32(q_pos.pointer, query_index)?,
                };
                let statistics = self.row_statistics(frame, dims, &operands, query, &slots, true)?;
                self.for_each(frame, head_dim, |dim| self.store(accumulator, dim, zero))?;
                self.for_each_visible_key(frame, dims, k_pos, query.position, |key| {
                    let kv_base = self.kv_base(dims, query.batch_index, key, query.kv_head)?;
                    let weight = self.score_gradient(frame, &operands, (query.base, kv_base), &statistics)?;
                    self.accumulate(frame, accumulator, weight, k, kv_base, head_dim)
                })?;
                self.write_row(frame, out, query.base, accumulator, head_dim)
            }),
            AttentionOperand::Key | AttentionOperand::Value => self.parallel(frame, batch * sk * hkv, |row| {
                // row = (b·sk + j)·hkv + g, the layout of k, v and the result.
                let kv_head = self.builder.build_int_unsigned_rem(row, self.index(hkv), "kv_head")?;
                let position_row = self.builder.build_int_unsigned_div(row, self.index(hkv), "position_row")?;
                let key_index = self.builder.build_int_unsigned_rem(position_row, self.index(sk), "key_index")?;
                let batch_index = self.builder.build_int_unsigned_div(position_row, self.index(sk), "batch_index")?;
                let kv_base = self.builder.build_int_mul(row, self.index(head_dim), "kv_base")?;
                let key_position = self.load_u32(k_pos.pointer, key_index)?;
                self.for_each(frame, head_dim, |dim| self.store(accumulator, dim, zero))?;
                self.for_each(frame, hq, |head| {
                    let reads = self.builder.build_int_compare(
                        IntPredicate::EQ,
                        self.local_kv_head(head, dims)?,
                        kv_head,
                        "reads_this_kv_head",
                    )?;
                    self.when(frame, reads, &|| {
                        self.for_each(frame, sq, |query_index| {
                            let query_position = self.load_u32(q_pos.pointer, query_index)?;
                            let sees = |body: &dyn Fn() -> Gen<()>| -> Gen<()> {
                                if causal {
                                    let visible = self.builder.build_int_compare(
                                        IntPredicate::ULE,
                                        key_position,
                                        query_position,
                                        "visible",
                                    )?;
                                    self.when(frame, visible, body)
                                } else {
                                    body()
                                }
                            };
                            sees(&|| {
                                // The query row (b, i, h): its statistics over every key it sees.
                                let query_row = self.builder.build_int_mul(batch_index, self.index(sq), "query_row")?;
                                let query_row = self.builder.build_int_nuw_add(query_row, query_index, "query_row")?;
                                let query_row = self.builder.build_int_mul(query_row, self.index(hq), "query_row")?;
                                let query_row = self.builder.build_int_nuw_add(query_row, head, "query_row")?;
                                let query = QueryRow {
                                    base: self.builder.build_int_mul(query_row, self.index(head_dim), "q_base")?,
                                    batch_index,
                                    kv_head,
                                    position: query_position,
                                };
                                let with_dp = wrt == AttentionOperand::Key;
                                let statistics = self.row_statistics(frame, dims, &operands, query, &slots, with_dp)?;
                                if with_dp {
                                    let rows = (query.base, kv_base);
                                    let weight = self.score_gradient(frame, &operands, rows, &statistics)?;
                                    self.accumulate(frame, accumulator, weight, q, query.base, head_dim)
                                } else {
                                    let rows = (query.base, kv_base);
                                    let probability = self.probability(frame, &operands, rows, &statistics)?;
                                    self.accumulate(frame, accumulator, probability, dy, query.base, head_dim)
                                }
                            })
                        })
                    })
                })?;
                self.write_row(frame, out, kv_base, accumulator, head_dim)
            }),
        }
    }

    /// The statistics of `query`'s softmax over the keys it sees (with `with_dp`, `Σ P·dP` too).
    fn row_statistics(
        &self,
        frame: &Frame<'ctx>,
        dims: &AttentionDims,
        operands: &Operands<'ctx>,
        query: QueryRow<'ctx>,
        slots: &RowSlots<'ctx>,
        with_dp: bool,
    ) -> Gen<Statistics<'ctx>> {
        let zero = self.f32_type.const_float(0.0);
        self.builder.build_store(slots.max, self.f32_type.const_float(f64::NEG_INFINITY))?;
        self.builder.build_store(slots.sum, zero)?;
        self.builder.build_store(slots.weighted_dp, zero)?;
        let scale = self.f32_type.const_float(f64::from(dims.scale));
        self.for_each_visible_key(frame, dims, operands.k_pos, query.position, |key| {
            let kv_base = self.kv_base(dims, query.batch_index, key, query.kv_head)?;
            let dot = self.head_dot(frame, (operands.q, query.base), (operands.k, kv_base), dims.head_dim)?;
            let score = self.builder.build_float_mul(dot, scale, "score")?;
            let (correction, weight) = self.softmax_step(slots.max, slots.sum, score)?;
            if with_dp {
                let dp = self.head_dot(frame, (operands.dy, query.base), (operands.v, kv_base), dims.head_dim)?;
                let old = self.builder.build_load(self.f32_type, slots.weighted_dp, "old_dp")?.into_float_value();
                let kept = self.builder.build_float_mul(old, correction, "kept_dp")?;
                let added = self.builder.build_float_mul(weight, dp, "added_dp")?;
                self.builder.build_store(slots.weighted_dp, self.builder.build_float_add(kept, added, "dp_sum")?)?;
            }
            Ok(())
        })?;
        let sum = self.builder.build_load(self.f32_type, slots.sum, "row_sum")?.into_float_value();
        let seen_any = self.builder.build_float_compare(FloatPredicate::OGT, sum, zero, "seen_any")?;
        let inverse = self.builder.build_float_div(self.f32_type.const_float(1.0), sum, "inverse_sum")?;
        // (A row that saw nothing contributes nothing: 1/0 would make NaNs of its zeros.)
        let inverse_sum = self.builder.build_select(seen_any, inverse, zero, "inverse")?.into_float_value();
        let weighted_dp = self.builder.build_load(self.f32_type, slots.weighted_dp, "weighted_dp")?.into_float_value();
        Ok(Statistics {
            max: self.builder.build_load(self.f32_type, slots.max, "max")?.into_float_value(),
            inverse_sum,
            mean_dp: self.builder.build_float_mul(weighted_dp, inverse_sum, "mean_dp")?,
        })
    }

    /// `P` of the query row at `q_base` and the key row at `kv_base`, by the row's statistics.
    fn probability(
        &self,
        frame: &Frame<'ctx>,
        operands: &Operands<'ctx>,
        (q_base, kv_base): (IntValue<'ctx>, IntValue<'ctx>),
        statistics: &Statistics<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let dot = self.head_dot(frame, (operands.q, q_base), (operands.k, kv_base), operands.head_dim)?;
        let score = self.builder.build_float_mul(dot, operands.scale, "score")?;
        let centered = self.builder.build_float_sub(score, statistics.max, "centered")?;
        Ok(self.builder.build_float_mul(self.exp(centered)?, statistics.inverse_sum, "probability")?)
    }

    /// `scale · P · (dP - Σ P·dP)`: the score's gradient, scaled, of the query row at `q_base` and
    /// the key row at `kv_base`.
    fn score_gradient(
        &self,
        frame: &Frame<'ctx>,
        operands: &Operands<'ctx>,
        (q_base, kv_base): (IntValue<'ctx>, IntValue<'ctx>),
        statistics: &Statistics<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        let probability = self.probability(frame, operands, (q_base, kv_base), statistics)?;
        let dp = self.head_dot(frame, (operands.dy, q_base), (operands.v, kv_base), operands.head_dim)?;
        let centered = self.builder.build_float_sub(dp, statistics.mean_dp, "centered_dp")?;
        let gradient = self.builder.build_float_mul(probability, centered, "score_gradient")?;
        Ok(self.builder.build_float_mul(gradient, operands.scale, "scaled_gradient")?)
    }

    /// `accumulator[d] += weight · source[base + d]` over a head's width.
    fn accumulate(
        &self,
        frame: &Frame<'ctx>,
        accumulator: PointerValue<'ctx>,
        weight: FloatValue<'ctx>,
        source: Operand<'ctx>,
        base: IntValue<'ctx>,
        head_dim: u64,
    ) -> Gen<()> {
        self.for_each(frame, head_dim, |dim| {
            let at = self.builder.build_int_nuw_add(base, dim, "source_at")?;
            let added = self.builder.build_float_mul(weight, self.read(source, at)?, "added")?;
            let sum = self.builder.build_float_add(self.load(accumulator, dim)?, added, "accumulated")?;
            self.store(accumulator, dim, sum)
        })
    }

    /// Writes the accumulator's head-wide row into `out` at `base`.
    fn write_row(
        &self,
        frame: &Frame<'ctx>,
        out: Operand<'ctx>,
        base: IntValue<'ctx>,
        accumulator: PointerValue<'ctx>,
        head_dim: u64,
    ) -> Gen<()> {
        self.for_each(frame, head_dim, |dim| {
            let at = self.builder.build_int_nuw_add(base, dim, "out_at")?;
            self.write(out, at, self.load(accumulator, dim)?)
        })
    }
}
