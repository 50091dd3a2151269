//! The embedding's gradient on a GPU, one table row a thread, as the runtime's `embedding_grad`
//! defines it: row `v` of the rank's block (global row `vocab_offset + v`) sums `dy` over the
//! tokens equal to its id, zeros where none is. A thread first counts its id among the tokens, then
//! a row that has some sums each column over the tokens (in f32; the runtime sums in f64), so the
//! rows no token names cost one pass over the ids. The runtime checks the ids on the host first, as
//! the CPU kernel does.

use inkwell::{FloatPredicate, IntPredicate};

use super::{Codegen, Frame, Gen};

impl<'ctx> Codegen<'ctx, '_> {
    /// The gradient of the embedding's table block of `rows` rows of `hidden` (see the module's doc).
    pub(super) fn embedding_grad(
        &self,
        frame: &Frame<'ctx>,
        tokens: u64,
        hidden: u64,
        vocab_offset: u64,
        rows: u64,
    ) -> Gen<()> {
        let (dy, token_ids, out) = (frame.inputs[0], frame.inputs[1], frame.outs[0]);
        let zero = self.f32_type.const_float(0.0);
        self.parallel(frame, rows, |row| {
            let id = self.builder.build_int_nuw_add(row, self.index(vocab_offset), "id")?;
            let base = self.builder.build_int_mul(row, self.index(hidden), "row_base")?;
            let named = |token: inkwell::values::IntValue<'ctx>| -> Gen<_> {
                let token_id = self.load_u32(token_ids.pointer, token)?;
                Ok(self.builder.build_int_compare(IntPredicate::EQ, token_id, id, "named")?)
            };
            let count = self.fold(frame, tokens, zero, |token, count| {
                let one = self.builder.build_select(named(token)?, self.f32_type.const_float(1.0), zero, "one")?;
                Ok(self.builder.build_float_add(count, one.into_float_value(), "count")?)
            })?;
            let used = self.builder.build_float_compare(FloatPredicate::OGT, count, zero, "used")?;
            let summed = || {
                self.for_each(frame, hidden, |column| {
                    let total = self.fold(frame, tokens, zero, |token, total| {
                        let at = self.builder.build_int_mul(token, self.index(hidden), "dy_row")?;
                        let at = self.builder.build_int_nuw_add(at, column, "dy_at")?;
                        let value = self.builder.build_select(named(token)?, self.read(dy, at)?, zero, "value")?;
                        Ok(self.builder.build_float_add(total, value.into_float_value(), "total")?)
                    })?;
                    let at = self.builder.build_int_nuw_add(base, column, "out_at")?;
                    self.write(out, at, total)
                })
            };
            self.branch(frame, used, &summed, &|| self.write_zeros(frame, out, base, hidden))
        })
    }
}
