//! The cross-entropy's gradient on a GPU, one logits row a thread, as the runtime's
//! `cross_entropy_grad` defines it: row `(b, s)` whose next token `t = tokens[b, s + 1]` exists
//! gets `(softmax(row) - onehot(t)) / terms`, the last position of each sequence zeros. Three
//! passes over the row: its maximum, its sum of `exp(logit - max)`, then the result (in f32; the
//! runtime's probabilities are f64). The runtime checks the token ids on the host first, as the CPU
//! kernel does, so an id past the vocabulary is an error before the launch.

use inkwell::IntPredicate;

use super::{Codegen, Frame, Gen};

/// The sizes of a `CrossEntropyGrad` kernel.
pub(crate) struct LossGradDims {
    pub batch: u64,
    pub seq: u64,
    pub vocab: u64,
    pub terms: u64,
}

impl<'ctx> Codegen<'ctx, '_> {
    /// The cross-entropy's gradient with respect to the logits (see the module's doc).
    pub(super) fn cross_entropy_grad(&self, frame: &Frame<'ctx>, dims: &LossGradDims) -> Gen<()> {
        let LossGradDims { batch, seq, vocab, terms } = *dims;
        let (logits, tokens, out) = (frame.inputs[0], frame.inputs[1], frame.outs[0]);
        let zero = self.f32_type.const_float(0.0);
        let inverse_terms = self.f32_type.const_float(1.0 / terms as f64);
        self.parallel(frame, batch * seq, |row| {
            let base = self.builder.build_int_mul(row, self.index(vocab), "row_base")?;
            let position = self.builder.build_int_unsigned_rem(row, self.index(seq), "position")?;
            let last = self.builder.build_int_compare(IntPredicate::EQ, position, self.index(seq - 1), "last")?;
            let scored = || {
                let next = self.builder.build_int_nuw_add(row, self.index(1), "next_token_at")?;
                let target = self.load_u32(tokens.pointer, next)?;
                let max = self.fold(frame, vocab, self.f32_type.const_float(f64::NEG_INFINITY), |column, max| {
                    let at = self.builder.build_int_nuw_add(base, column, "logit_at")?;
                    self.call_binary_float("llvm.maxnum", max, self.read(logits, at)?)
                })?;
                let sum = self.fold(frame, vocab, zero, |column, sum| {
                    let at = self.builder.build_int_nuw_add(base, column, "logit_at")?;
                    let centered = self.builder.build_float_sub(self.read(logits, at)?, max, "centered")?;
                    Ok(self.builder.build_float_add(sum, self.exp(centered)?, "sum")?)
                })?;
                let log_sum = self.ln(sum)?;
                self.for_each(frame, vocab, |column| {
                    let at = self.builder.build_int_nuw_add(base, column, "logit_at")?;
                    let centered = self.builder.build_float_sub(self.read(logits, at)?, max, "centered")?;
                    let log_probability = self.builder.build_float_sub(centered, log_sum, "log_probability")?;
                    let probability = self.exp(log_probability)?;
                    let is_target = self.builder.build_int_compare(IntPredicate::EQ, column, target, "is_target")?;
                    let one_hot = self
                        .builder
                        .build_select(is_target, self.f32_type.const_float(1.0), zero, "one_hot")?
                        .into_float_value();
                    let difference = self.builder.build_float_sub(probability, one_hot, "difference")?;
                    self.write(out, at, self.builder.build_float_mul(difference, inverse_terms, "gradient")?)
                })
            };
            self.branch(frame, last, &|| self.write_zeros(frame, out, base, vocab), &scored)
        })
    }
}
