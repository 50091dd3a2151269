//! LLVM IR for pleat's elementwise and row-wise kernels: one function a [`NativeKernel`], every size
//! a constant of the program.
//!
//! On the host, each function is a loop nest that repeats the interpreted kernel's arithmetic in the
//! same order and precision (f64 sum of squares for RMSNorm, f64 cosine and sine for RoPE, libm's
//! `expf` for SiLU), with no fast-math flags, so that its results equal the runtime's bit for bit.
//! For NVPTX, each function is a `.entry` kernel (calling convention `ptx_kernel`) whose outer loop
//! becomes one thread a row or element (`ctaid.x * ntid.x + tid.x`); there, `exp`, `sin` and `cos`
//! use the GPU's approximate instructions.

use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::intrinsics::Intrinsic;
use inkwell::module::{Linkage, Module};
use inkwell::types::{BasicTypeEnum, FloatType, IntType, PointerType};
use inkwell::values::{BasicMetadataValueEnum, FloatValue, FunctionValue, IntValue, PointerValue, ValueKind};
use inkwell::{AddressSpace, FloatPredicate, IntPredicate};

use crate::native::NativeKernel;
use crate::program::{AttentionDims, Instr, Kernel, Program};

use super::LlvmError;

mod attention_grad;
mod embedding_grad;
mod loss_grad;

/// LLVM's number of the `ptx_kernel` calling convention: the function becomes a PTX `.entry`.
const PTX_KERNEL_CALLING_CONVENTION: u32 = 71;

/// Which machine the functions are for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Flavor {
    /// The CPU: the outer loop is a loop.
    Host,
    /// NVPTX: the outer loop is the thread grid.
    Ptx,
}

type Gen<T> = Result<T, LlvmError>;

/// Builds kernel functions into one module.
pub(crate) struct Codegen<'ctx, 'module> {
    context: &'ctx Context,
    module: &'module Module<'ctx>,
    builder: Builder<'ctx>,
    flavor: Flavor,
    elements: Elements,
    f32_type: FloatType<'ctx>,
    f64_type: FloatType<'ctx>,
    i64_type: IntType<'ctx>,
    ptr_type: PointerType<'ctx>,
    /// The items (threads on a GPU) of the last kernel's `parallel` loop.
    items: std::cell::Cell<u64>,
}

/// How a function's float operands lie in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Elements {
    /// Every float operand is f32: the host runtime widens a bf16 buffer for a native call and
    /// rounds the result it gets back.
    Widened,
    /// Each operand at its buffer's declared dtype (f32 or bf16), as a GPU's memory holds it: a
    /// bf16 element is widened when read and rounded to nearest even when written, as the host
    /// runtime stores a bf16 result.
    Declared,
}

/// Which way a RoPE kernel turns: the forward rotation, or its transpose (the gradient).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rotation {
    Forward,
    Inverse,
}

/// The function being built: its value and its pointer arguments.
struct Frame<'ctx> {
    function: FunctionValue<'ctx>,
    /// The loaded `inputs[i]` pointers.
    inputs: Vec<Operand<'ctx>>,
    /// The output pointers (one, or two for a fused add + norm).
    outs: Vec<Operand<'ctx>>,
}

/// One of a function's buffers: its pointer, whether its floats are bf16 in memory, and whether
/// the runtime stores them as bf16 (declared so, whatever the layout of the call).
#[derive(Clone, Copy)]
struct Operand<'ctx> {
    pointer: PointerValue<'ctx>,
    bf16: bool,
    stored_bf16: bool,
}

impl<'ctx, 'module> Codegen<'ctx, 'module> {
    /// A generator adding functions to `module`, their operands laid out as `elements` says.
    pub(crate) fn new(
        context: &'ctx Context,
        module: &'module Module<'ctx>,
        flavor: Flavor,
        elements: Elements,
    ) -> Self {
        Codegen {
            context,
            module,
            builder: context.create_builder(),
            flavor,
            elements,
            f32_type: context.f32_type(),
            f64_type: context.f64_type(),
            i64_type: context.i64_type(),
            ptr_type: context.ptr_type(AddressSpace::default()),
            items: std::cell::Cell::new(0),
        }
    }

    /// The items of the last kernel defined: its threads on a GPU, one a row or element (0 when
    /// it has no work, as a RoPE of head width 1).
    pub(crate) fn items(&self) -> u64 {
        self.items.get()
    }

    /// Defines `u64 pleat_program_fingerprint(void)` returning `fingerprint`.
    pub(crate) fn define_fingerprint(&self, fingerprint: u64) -> Gen<()> {
        let function_type = self.i64_type.fn_type(&[], false);
        let function =
            self.module.add_function(crate::native::FINGERPRINT_SYMBOL, function_type, Some(Linkage::External));
        let entry = self.context.append_basic_block(function, "entry");
        self.builder.position_at_end(entry);
        self.builder.build_return(Some(&self.i64_type.const_int(fingerprint, false)))?;
        Ok(())
    }

    /// Defines the function of `native`, with the sizes `program` gives.
    pub(crate) fn define(&self, program: &Program, native: &NativeKernel) -> Gen<FunctionValue<'ctx>> {
        let kernel_at = |instr: usize| match program.instructions.get(instr) {
            Some(Instr::Kernel { kernel, inputs, out }) => Ok((kernel, inputs, *out)),
            _ => Err(LlvmError::NotAKernel { instr }),
        };
        let numel = |id: crate::BufferId| program.buffer(id).numel();
        self.items.set(0);
        let first = native.first_instr();
        let (operands, results) = native.buffers(program).ok_or(LlvmError::NotAKernel { instr: first })?;
        let frame = self.begin(program, &native.symbol(), &operands, &results)?;
        match native {
            NativeKernel::Single { instr } => {
                let (kernel, inputs, out) = kernel_at(*instr)?;
                match kernel {
                    Kernel::Add => self.add(&frame, numel(inputs[0]), numel(inputs[1]))?,
                    Kernel::SiluMul => self.silu_mul(&frame, numel(out))?,
                    Kernel::RmsNorm { hidden, eps } => self.rms_norm(&frame, numel(out) / hidden, *hidden, *eps)?,
                    Kernel::Rope { batch, seq, heads, head_dim, inv_freq } => {
                        self.rope(&frame, [*batch, *seq, *heads, *head_dim], inv_freq, *instr, Rotation::Forward)?
                    }
                    Kernel::RopeGrad { batch, seq, heads, head_dim, inv_freq } => {
                        self.rope(&frame, [*batch, *seq, *heads, *head_dim], inv_freq, *instr, Rotation::Inverse)?
                    }
                    Kernel::SiluMulGradGate => self.silu_mul_grad_gate(&frame, numel(out))?,
                    Kernel::RmsNormGradInput { hidden, eps } => {
                        self.rms_norm_grad_input(&frame, numel(out) / hidden, *hidden, *eps, false)?
                    }
                    Kernel::RmsNormGradInputAdd { hidden, eps } => {
                        self.rms_norm_grad_input(&frame, numel(out) / hidden, *hidden, *eps, true)?
                    }
                    Kernel::Attention { dims, with_lse } => self.attention(&frame, dims, *with_lse)?,
                    Kernel::AttentionGrad { wrt, dims } => self.attention_grad(&frame, dims, *wrt)?,
                    Kernel::CrossEntropyGrad { batch, seq, vocab, terms } => {
                        let dims = loss_grad::LossGradDims { batch: *batch, seq: *seq, vocab: *vocab, terms: *terms };
                        self.cross_entropy_grad(&frame, &dims)?
                    }
                    Kernel::Sum => self.sum(&frame, numel(out))?,
                    Kernel::EmbeddingGrad { hidden, vocab_offset, .. } => {
                        self.embedding_grad(&frame, numel(inputs[1]), *hidden, *vocab_offset, numel(out) / hidden)?
                    }
                    Kernel::MergeAttention { rows, head_dim } => self.merge_attention(&frame, *rows, *head_dim)?,
                    Kernel::Embedding { hidden, vocab_offset, .. } => {
                        self.embedding(&frame, numel(inputs[1]), *hidden, *vocab_offset, numel(inputs[0]) / hidden)?
                    }
                    _ => return Err(LlvmError::NotAKernel { instr: *instr }),
                }
                self.finish(frame)
            }
            NativeKernel::FusedAddRmsNorm { add_instr, norm_instr } => {
                let (_, add_inputs, _) = kernel_at(*add_instr)?;
                let (Kernel::RmsNorm { hidden, eps }, _, _) = kernel_at(*norm_instr)? else {
                    return Err(LlvmError::NotAKernel { instr: *norm_instr });
                };
                self.add_rms_norm(&frame, numel(add_inputs[0]) / hidden, *hidden, *eps)?;
                self.finish(frame)
            }
        }
    }

    /// Declares `void name(ptr inputs, ptr out...)` for `program`'s buffers `operands` and
    /// `results`, and loads the operand pointers.
    fn begin(
        &self,
        program: &Program,
        name: &str,
        operands: &[crate::BufferId],
        results: &[crate::BufferId],
    ) -> Gen<Frame<'ctx>> {
        let stored_bf16 = |id: &crate::BufferId| program.buffer(*id).dtype == pleat_ir::DType::Bf16;
        let operand = |pointer, id: &crate::BufferId| Operand {
            pointer,
            bf16: self.elements == Elements::Declared && stored_bf16(id),
            stored_bf16: stored_bf16(id),
        };
        let (out_count, input_count) = (results.len(), operands.len());
        let parameters = vec![self.ptr_type.into(); 1 + out_count];
        let function_type = self.context.void_type().fn_type(&parameters, false);
        let function = self.module.add_function(name, function_type, Some(Linkage::External));
        if self.flavor == Flavor::Ptx {
            function.set_call_conventions(PTX_KERNEL_CALLING_CONVENTION);
        }
        // The runtime allocates every result fresh: outputs alias nothing, which lets LLVM vectorize.
        let noalias =
            self.context.create_enum_attribute(inkwell::attributes::Attribute::get_named_enum_kind_id("noalias"), 0);
        for out_index in 0..out_count {
            function.add_attribute(inkwell::attributes::AttributeLoc::Param(1 + out_index as u32), noalias);
        }
        let nounwind =
            self.context.create_enum_attribute(inkwell::attributes::Attribute::get_named_enum_kind_id("nounwind"), 0);
        function.add_attribute(inkwell::attributes::AttributeLoc::Function, nounwind);
        let entry = self.context.append_basic_block(function, "entry");
        self.builder.position_at_end(entry);
        let out_names: &[&str] = if out_count == 1 { &["out"] } else { &["sum", "normed"] };
        for (index, name) in ["inputs"].iter().chain(out_names).enumerate() {
            self.parameter(function, index as u32)?.set_name(name);
        }
        let inputs_array = self.parameter(function, 0)?;
        let mut inputs = Vec::with_capacity(input_count);
        for (index, id) in operands.iter().enumerate() {
            let slot = self.element(self.ptr_type.into(), inputs_array, self.index(index as u64))?;
            let pointer = self.builder.build_load(self.ptr_type, slot, &format!("input{index}"))?;
            inputs.push(operand(pointer.into_pointer_value(), id));
        }
        let outs = results
            .iter()
            .enumerate()
            .map(|(index, id)| Ok(operand(self.parameter(function, 1 + index as u32)?, id)))
            .collect::<Gen<Vec<_>>>()?;
        Ok(Frame { function, inputs, outs })
    }

    fn finish(&self, frame: Frame<'ctx>) -> Gen<FunctionValue<'ctx>> {
        self.builder.build_return(None)?;
        Ok(frame.function)
    }

    fn parameter(&self, function: FunctionValue<'ctx>, index: u32) -> Gen<PointerValue<'ctx>> {
        function
            .get_nth_param(index)
            .map(|value| value.into_pointer_value())
            .ok_or(LlvmError::Builder { message: format!("the function has no parameter {index}") })
    }

    // === Kernels ===

    /// `out = a + b`, `b` (of `b_len`) repeating over `a` (of `a_len`) when shorter.
    fn add(&self, frame: &Frame<'ctx>, a_len: u64, b_len: u64) -> Gen<()> {
        let (a, b, out) = (frame.inputs[0], frame.inputs[1], frame.outs[0]);
        if a_len == b_len {
            return self.parallel(frame, a_len, |index| {
                let sum = self.builder.build_float_add(self.read(a, index)?, self.read(b, index)?, "sum")?;
                self.write(out, index, sum)
            });
        }
        self.parallel(frame, a_len / b_len, |row| {
            let base = self.builder.build_int_mul(row, self.index(b_len), "base")?;
            self.for_each(frame, b_len, |column| {
                let index = self.builder.build_int_nuw_add(base, column, "index")?;
                let sum = self.builder.build_float_add(self.read(a, index)?, self.read(b, column)?, "sum")?;
                self.write(out, index, sum)
            })
        })
    }

    /// `out = ((a + b) + c) + ..` over every operand, left to right as the runtime sums them (in f32,
    /// rounded once when written).
    fn sum(&self, frame: &Frame<'ctx>, len: u64) -> Gen<()> {
        let out = frame.outs[0];
        self.parallel(frame, len, |index| {
            let (first, rest) =
                frame.inputs.split_first().ok_or(LlvmError::Builder { message: "a sum of nothing".into() })?;
            let mut total = self.read(*first, index)?;
            for (position, operand) in rest.iter().enumerate() {
                // Each partial sum as the add it replaces stored it (the first is not one).
                if position > 0 {
                    total = self.as_stored(out, total)?;
                }
                total = self.builder.build_float_add(total, self.read(*operand, index)?, "sum")?;
            }
            self.write(out, index, total)
        })
    }

    /// `out = gate / (1 + exp(-gate)) * up`, in the runtime's order.
    fn silu_mul(&self, frame: &Frame<'ctx>, len: u64) -> Gen<()> {
        let (gate, up, out) = (frame.inputs[0], frame.inputs[1], frame.outs[0]);
        self.parallel(frame, len, |index| {
            let gate_value = self.read(gate, index)?;
            let negated = self.builder.build_float_neg(gate_value, "negated")?;
            let exponential = self.exp(negated)?;
            let denominator =
                self.builder.build_float_add(self.f32_type.const_float(1.0), exponential, "denominator")?;
            let silu = self.builder.build_float_div(gate_value, denominator, "silu")?;
            let product = self.builder.build_float_mul(silu, self.read(up, index)?, "product")?;
            self.write(out, index, product)
        })
    }

    /// RMSNorm of `rows` rows of `hidden`: `out = weight * (x * (1 / sqrt(mean(x²) + eps)))`.
    fn rms_norm(&self, frame: &Frame<'ctx>, rows: u64, hidden: u64, eps: f64) -> Gen<()> {
        let (x, weight, out) = (frame.inputs[0], frame.inputs[1], frame.outs[0]);
        self.parallel(frame, rows, |row| {
            let base = self.builder.build_int_mul(row, self.index(hidden), "base")?;
            let sum_of_squares = self.fold(frame, hidden, self.f64_type.const_float(0.0), |column, sum| {
                let index = self.builder.build_int_nuw_add(base, column, "index")?;
                self.accumulate_square(sum, self.read(x, index)?)
            })?;
            let inverse_rms = self.inverse_rms(sum_of_squares, hidden, eps)?;
            self.scale_row(frame, base, hidden, x, weight, out, inverse_rms)
        })
    }

    /// `sum = a + b` and `normed = rms_norm(sum, weight)` in one pass a row: the sum is written and
    /// its squares summed in the same loop, then the row is scaled.
    fn add_rms_norm(&self, frame: &Frame<'ctx>, rows: u64, hidden: u64, eps: f64) -> Gen<()> {
        let (a, b, weight) = (frame.inputs[0], frame.inputs[1], frame.inputs[2]);
        let (sum, normed) = (frame.outs[0], frame.outs[1]);
        self.parallel(frame, rows, |row| {
            let base = self.builder.build_int_mul(row, self.index(hidden), "base")?;
            let sum_of_squares = self.fold(frame, hidden, self.f64_type.const_float(0.0), |column, total| {
                let index = self.builder.build_int_nuw_add(base, column, "index")?;
                let value = self.builder.build_float_add(self.read(a, index)?, self.read(b, index)?, "value")?;
                self.write(sum, index, value)?;
                // The norm reads the sum as stored (rounded, when bf16), as the two kernels apart do.
                self.accumulate_square(total, self.as_stored(sum, value)?)
            })?;
            let inverse_rms = self.inverse_rms(sum_of_squares, hidden, eps)?;
            self.scale_row(frame, base, hidden, sum, weight, normed, inverse_rms)
        })
    }

    /// `total + (value as f64)²`.
    fn accumulate_square(&self, total: FloatValue<'ctx>, value: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let wide = self.builder.build_float_ext(value, self.f64_type, "wide")?;
        let square = self.builder.build_float_mul(wide, wide, "square")?;
        Ok(self.builder.build_float_add(total, square, "total")?)
    }

    /// `1 / sqrt((sum / hidden) as f32 + eps)`.
    fn inverse_rms(&self, sum_of_squares: FloatValue<'ctx>, hidden: u64, eps: f64) -> Gen<FloatValue<'ctx>> {
        let mean = self.builder.build_float_div(sum_of_squares, self.f64_type.const_float(hidden as f64), "mean")?;
        let mean = self.builder.build_float_trunc(mean, self.f32_type, "mean_f32")?;
        // The runtime rounds eps to f32 before adding it.
        let shifted = self.builder.build_float_add(mean, self.f32_type.const_float(eps as f32 as f64), "shifted")?;
        let root = self.call_float("llvm.sqrt", shifted)?;
        Ok(self.builder.build_float_div(self.f32_type.const_float(1.0), root, "inverse_rms")?)
    }

    /// `out[base + c] = weight[c] * (x[base + c] * inverse_rms)` for each column.
    #[allow(clippy::too_many_arguments)]
    fn scale_row(
        &self,
        frame: &Frame<'ctx>,
        base: IntValue<'ctx>,
        hidden: u64,
        x: Operand<'ctx>,
        weight: Operand<'ctx>,
        out: Operand<'ctx>,
        inverse_rms: FloatValue<'ctx>,
    ) -> Gen<()> {
        self.for_each(frame, hidden, |column| {
            let index = self.builder.build_int_nuw_add(base, column, "index")?;
            // As stored: a fused add hands the host runtime its sum widened and unrounded.
            let value = self.as_stored(x, self.read(x, index)?)?;
            let scaled = self.builder.build_float_mul(value, inverse_rms, "scaled")?;
            let result = self.builder.build_float_mul(self.read(weight, column)?, scaled, "result")?;
            self.write(out, index, result)
        })
    }

    /// `out = dy · up · silu'(gate)`, `silu'(g) = s·(1 + g·(1 - s))` with `s = sigmoid(g)`, in f32
    /// (the runtime's kernel works in f64; this one runs on a GPU only).
    fn silu_mul_grad_gate(&self, frame: &Frame<'ctx>, len: u64) -> Gen<()> {
        let (gate, up, dy, out) = (frame.inputs[0], frame.inputs[1], frame.inputs[2], frame.outs[0]);
        let one = self.f32_type.const_float(1.0);
        self.parallel(frame, len, |index| {
            let gate_value = self.read(gate, index)?;
            let negated = self.builder.build_float_neg(gate_value, "negated")?;
            let denominator = self.builder.build_float_add(one, self.exp(negated)?, "denominator")?;
            let sigmoid = self.builder.build_float_div(one, denominator, "sigmoid")?;
            let complement = self.builder.build_float_sub(one, sigmoid, "complement")?;
            let slope = self.builder.build_float_mul(gate_value, complement, "slope")?;
            let slope = self.builder.build_float_add(one, slope, "slope")?;
            let derivative = self.builder.build_float_mul(sigmoid, slope, "derivative")?;
            let upstream = self.builder.build_float_mul(self.read(dy, index)?, self.read(up, index)?, "upstream")?;
            let result = self.builder.build_float_mul(upstream, derivative, "result")?;
            self.write(out, index, result)
        })
    }

    /// The gradient of RMSNorm with respect to its input, `rows` rows of `hidden` a thread each: with
    /// `r = 1 / sqrt(mean(x²) + eps)` and `g = dy · weight`, `dx = r·g - x·r³·mean(g·x)`, the row's
    /// sums and `r` in f64 as the runtime's kernel; with `accumulate` the result, rounded as the
    /// output's dtype stores it, is added to the fourth operand (`RmsNormGradInputAdd`) before it is
    /// stored.
    fn rms_norm_grad_input(&self, frame: &Frame<'ctx>, rows: u64, hidden: u64, eps: f64, accumulate: bool) -> Gen<()> {
        let (x, weight, dy, out) = (frame.inputs[0], frame.inputs[1], frame.inputs[2], frame.outs[0]);
        let accumulated = accumulate.then(|| frame.inputs[3]);
        let wide = |value: FloatValue<'ctx>, name: &str| self.builder.build_float_ext(value, self.f64_type, name);
        self.parallel(frame, rows, |row| {
            let base = self.builder.build_int_mul(row, self.index(hidden), "base")?;
            let column_index = |column| self.builder.build_int_nuw_add(base, column, "index");
            // `g` of a column, in f64.
            let scaled = |column: IntValue<'ctx>, index: IntValue<'ctx>| -> Gen<FloatValue<'ctx>> {
                let gradient = wide(self.read(dy, index)?, "dy")?;
                Ok(self.builder.build_float_mul(gradient, wide(self.read(weight, column)?, "weight")?, "g")?)
            };
            let sum_of_squares = self.fold(frame, hidden, self.f64_type.const_float(0.0), |column, total| {
                self.accumulate_square(total, self.read(x, column_index(column)?)?)
            })?;
            let sum_gx = self.fold(frame, hidden, self.f64_type.const_float(0.0), |column, total| {
                let index = column_index(column)?;
                let product =
                    self.builder.build_float_mul(scaled(column, index)?, wide(self.read(x, index)?, "x")?, "gx")?;
                Ok(self.builder.build_float_add(total, product, "sum_gx")?)
            })?;
            let count = self.f64_type.const_float(hidden as f64);
            let mean_square = self.builder.build_float_div(sum_of_squares, count, "mean_square")?;
            let shifted = self.builder.build_float_add(mean_square, self.f64_type.const_float(eps), "shifted")?;
            let root = self.call_float("llvm.sqrt", shifted)?;
            let r = self.builder.build_float_div(self.f64_type.const_float(1.0), root, "r")?;
            let mean_gx = self.builder.build_float_div(sum_gx, count, "mean_gx")?;
            let r_cubed = self.builder.build_float_mul(self.builder.build_float_mul(r, r, "r2")?, r, "r3")?;
            let correction = self.builder.build_float_mul(r_cubed, mean_gx, "correction")?;
            self.for_each(frame, hidden, |column| {
                let index = column_index(column)?;
                let direct = self.builder.build_float_mul(r, scaled(column, index)?, "direct")?;
                let removed = self.builder.build_float_mul(wide(self.read(x, index)?, "x")?, correction, "removed")?;
                let gradient = self.builder.build_float_sub(direct, removed, "dx")?;
                let mut result = self.builder.build_float_trunc(gradient, self.f32_type, "dx_f32")?;
                if let Some(accumulated) = accumulated {
                    // The gradient as the instruction this fuses stored it, then the add.
                    result = self.as_stored(out, result)?;
                    result = self.builder.build_float_add(result, self.read(accumulated, index)?, "dx_added")?;
                }
                self.write(out, index, result)
            })
        })
    }

    /// RoPE (rotate-half) of `x[batch, seq, heads, head_dim]` at `positions[seq]` into `out`, or with
    /// [`Rotation::Inverse`] its gradient, the rotation by the opposite angles (`sin` negated,
    /// exactly).
    fn rope(&self, frame: &Frame<'ctx>, dims: [u64; 4], inv_freq: &[f32], instr: usize, rotation: Rotation) -> Gen<()> {
        let [batch, seq, heads, head_dim] = dims;
        let half = head_dim / 2;
        if half == 0 {
            return Ok(());
        }
        let (x, positions, out) = (frame.inputs[0], frame.inputs[1], frame.outs[0]);
        let frequencies = self.constant_table(&format!("inv_freq.{instr}"), inv_freq)?;
        let rotate = |base: IntValue<'ctx>, pair: IntValue<'ctx>, cos: FloatValue<'ctx>, sin: FloatValue<'ctx>| {
            let sin = match rotation {
                Rotation::Forward => sin,
                Rotation::Inverse => self.builder.build_float_neg(sin, "inverse_sin")?,
            };
            let first_index = self.builder.build_int_nuw_add(base, pair, "first")?;
            let second_index = self.builder.build_int_nuw_add(first_index, self.index(half), "second")?;
            let (first, second) = (self.read(x, first_index)?, self.read(x, second_index)?);
            let first_cos = self.builder.build_float_mul(first, cos, "first_cos")?;
            let second_sin = self.builder.build_float_mul(second, sin, "second_sin")?;
            let second_cos = self.builder.build_float_mul(second, cos, "second_cos")?;
            let first_sin = self.builder.build_float_mul(first, sin, "first_sin")?;
            self.write(out, first_index, self.builder.build_float_sub(first_cos, second_sin, "rotated_first")?)?;
            self.write(out, second_index, self.builder.build_float_add(second_cos, first_sin, "rotated_second")?)
        };
        match self.flavor {
            Flavor::Host => {
                // One cosine and sine table a position, shared by every batch entry and head.
                let table_type = self.f32_type.array_type(half as u32);
                let cos_table = self.builder.build_alloca(table_type, "cos_table")?;
                let sin_table = self.builder.build_alloca(table_type, "sin_table")?;
                self.for_each(frame, seq, |position_index| {
                    let position = self.position(positions.pointer, position_index)?;
                    self.for_each(frame, half, |pair| {
                        let angle = self.angle(position, frequencies, pair)?;
                        let wide = self.builder.build_float_ext(angle, self.f64_type, "angle_f64")?;
                        // The C library's, as the runtime's kernel; scalar, as `exp` explains.
                        let cos = self.call_libm("cos", wide)?;
                        let sin = self.call_libm("sin", wide)?;
                        let cos = self.builder.build_float_trunc(cos, self.f32_type, "cos")?;
                        let sin = self.builder.build_float_trunc(sin, self.f32_type, "sin")?;
                        self.store(cos_table, pair, cos)?;
                        self.store(sin_table, pair, sin)
                    })?;
                    self.for_each(frame, batch, |batch_index| {
                        self.for_each(frame, heads, |head| {
                            let row = self.builder.build_int_mul(batch_index, self.index(seq), "row")?;
                            let row = self.builder.build_int_nuw_add(row, position_index, "row")?;
                            let row = self.builder.build_int_mul(row, self.index(heads), "row")?;
                            let row = self.builder.build_int_nuw_add(row, head, "row")?;
                            let base = self.builder.build_int_mul(row, self.index(head_dim), "base")?;
                            self.for_each(frame, half, |pair| {
                                rotate(base, pair, self.load(cos_table, pair)?, self.load(sin_table, pair)?)
                            })
                        })
                    })
                })
            }
            Flavor::Ptx => self.parallel(frame, batch * seq * heads, |head_row| {
                let position_index = self.builder.build_int_unsigned_div(head_row, self.index(heads), "row")?;
                let position_index =
                    self.builder.build_int_unsigned_rem(position_index, self.index(seq), "position_index")?;
                let position = self.position(positions.pointer, position_index)?;
                let base = self.builder.build_int_mul(head_row, self.index(head_dim), "base")?;
                self.for_each(frame, half, |pair| {
                    let angle = self.angle(position, frequencies, pair)?;
                    let reduced = self.reduce_angle(angle)?;
                    let cos = self.call_nvvm("llvm.nvvm.cos.approx.f", reduced)?;
                    let sin = self.call_nvvm("llvm.nvvm.sin.approx.f", reduced)?;
                    rotate(base, pair, cos, sin)
                })
            }),
        }
    }

    /// `positions[index]` (a `u32`) as f32.
    fn position(&self, positions: PointerValue<'ctx>, index: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let position = self.load_u32(positions, index)?;
        Ok(self.builder.build_unsigned_int_to_float(position, self.f32_type, "position_f32")?)
    }

    /// Scaled dot-product attention, one query row (batch entry, position, head) an item: an online
    /// softmax over the keys in order, with the causal mask by absolute position (`k_pos[j] <=
    /// q_pos[i]`, so sharded and zigzag orders need nothing special) and grouped query heads, as
    /// the runtime's tiled kernel defines it. The row's running maximum, running sum and
    /// unnormalized output live in the function's frame (registers and local memory on a GPU).
    /// A row that sees no key gets zeros, and with `with_lse` a log-sum-exp of `-inf`.
    fn attention(&self, frame: &Frame<'ctx>, dims: &AttentionDims, with_lse: bool) -> Gen<()> {
        let AttentionDims { batch, sq, hq, head_dim, scale, .. } = *dims;
        let [q, k, v, q_pos, k_pos] = frame.inputs[..] else {
            return Err(LlvmError::Builder {
                message: format!("attention takes 5 operands, not {}", frame.inputs.len()),
            });
        };
        let out = frame.outs[0];
        let out_width = head_dim + u64::from(with_lse);
        // In the entry block, so that a GPU keeps them in the thread's frame (no dynamic alloca).
        let accumulator = self.builder.build_alloca(self.f32_type.array_type(head_dim as u32), "accumulator")?;
        let running_max = self.builder.build_alloca(self.f32_type, "running_max")?;
        let running_sum = self.builder.build_alloca(self.f32_type, "running_sum")?;
        let negative_infinity = self.f32_type.const_float(f64::NEG_INFINITY);
        let zero = self.f32_type.const_float(0.0);
        self.parallel(frame, batch * sq * hq, |row| {
            // row = (b·sq + i)·hq + h, the layout of q and of the output.
            let head = self.builder.build_int_unsigned_rem(row, self.index(hq), "head")?;
            let position_row = self.builder.build_int_unsigned_div(row, self.index(hq), "position_row")?;
            let query_index = self.builder.build_int_unsigned_rem(position_row, self.index(sq), "query_index")?;
            let batch_index = self.builder.build_int_unsigned_div(position_row, self.index(sq), "batch_index")?;
            let kv_head = self.local_kv_head(head, dims)?;
            let q_base = self.builder.build_int_mul(row, self.index(head_dim), "q_base")?;
            let query_position = self.load_u32(q_pos.pointer, query_index)?;
            self.builder.build_store(running_max, negative_infinity)?;
            self.builder.build_store(running_sum, zero)?;
            self.for_each(frame, head_dim, |dim| self.store(accumulator, dim, zero))?;
            self.for_each_visible_key(frame, dims, k_pos, query_position, |key| {
                let kv_base = self.kv_base(dims, batch_index, key, kv_head)?;
                let dot = self.head_dot(frame, (q, q_base), (k, kv_base), head_dim)?;
                let score = self.builder.build_float_mul(dot, self.f32_type.const_float(f64::from(scale)), "score")?;
                let (correction, weight) = self.softmax_step(running_max, running_sum, score)?;
                self.for_each(frame, head_dim, |dim| {
                    let value_at = self.builder.build_int_nuw_add(kv_base, dim, "value_at")?;
                    let kept = self.builder.build_float_mul(self.load(accumulator, dim)?, correction, "kept")?;
                    let added = self.builder.build_float_mul(weight, self.read(v, value_at)?, "added")?;
                    self.store(accumulator, dim, self.builder.build_float_add(kept, added, "accumulated")?)
                })
            })?;
            let sum = self.builder.build_load(self.f32_type, running_sum, "row_sum")?.into_float_value();
            let seen_any = self.builder.build_float_compare(FloatPredicate::OGT, sum, zero, "seen_any")?;
            let inverse = self.builder.build_float_div(self.f32_type.const_float(1.0), sum, "inverse_sum")?;
            // (A row that saw nothing has a zero accumulator; 0 · 1/0 would be NaN.)
            let inverse = self.builder.build_select(seen_any, inverse, zero, "inverse")?.into_float_value();
            let out_base = self.builder.build_int_mul(row, self.index(out_width), "out_base")?;
            self.for_each(frame, head_dim, |dim| {
                let out_at = self.builder.build_int_nuw_add(out_base, dim, "out_at")?;
                let normalized = self.builder.build_float_mul(self.load(accumulator, dim)?, inverse, "normalized")?;
                self.write(out, out_at, normalized)
            })?;
            if with_lse {
                let max = self.builder.build_load(self.f32_type, running_max, "row_max")?.into_float_value();
                let lse = self.builder.build_float_add(max, self.ln(sum)?, "lse")?;
                let lse = self.builder.build_select(seen_any, lse, negative_infinity, "lse")?.into_float_value();
                let lse_at = self.builder.build_int_nuw_add(out_base, self.index(head_dim), "lse_at")?;
                self.write(out, lse_at, lse)?;
            }
            Ok(())
        })
    }

    /// The local kv head local query head `head` reads: global query head `q_head_offset + head`
    /// reads global kv head `(q_head_offset + head) / group`, local at that minus `kv_head_offset`
    /// (`device_kernels` checked that every query head's is local).
    fn local_kv_head(&self, head: IntValue<'ctx>, dims: &AttentionDims) -> Gen<IntValue<'ctx>> {
        let global_head = self.builder.build_int_nuw_add(head, self.index(dims.q_head_offset), "global_head")?;
        let global_kv_head = self.builder.build_int_unsigned_div(global_head, self.index(dims.group), "global_kv")?;
        Ok(self.builder.build_int_nuw_sub(global_kv_head, self.index(dims.kv_head_offset), "kv_head")?)
    }

    /// Where key (and value) row `(batch_index, key, kv_head)` starts.
    fn kv_base(
        &self,
        dims: &AttentionDims,
        batch_index: IntValue<'ctx>,
        key: IntValue<'ctx>,
        kv_head: IntValue<'ctx>,
    ) -> Gen<IntValue<'ctx>> {
        let row = self.builder.build_int_mul(batch_index, self.index(dims.sk), "key_row")?;
        let row = self.builder.build_int_nuw_add(row, key, "key_row")?;
        let row = self.builder.build_int_mul(row, self.index(dims.hkv), "key_row")?;
        let row = self.builder.build_int_nuw_add(row, kv_head, "key_row")?;
        Ok(self.builder.build_int_mul(row, self.index(dims.head_dim), "kv_base")?)
    }

    /// Runs `body(key)` for each key `query_position` sees (every key without the causal mask).
    fn for_each_visible_key(
        &self,
        frame: &Frame<'ctx>,
        dims: &AttentionDims,
        k_pos: Operand<'ctx>,
        query_position: IntValue<'ctx>,
        body: impl Fn(IntValue<'ctx>) -> Gen<()>,
    ) -> Gen<()> {
        self.for_each(frame, dims.sk, |key| {
            if !dims.causal {
                return body(key);
            }
            let key_position = self.load_u32(k_pos.pointer, key)?;
            let visible = self.builder.build_int_compare(IntPredicate::ULE, key_position, query_position, "visible")?;
            self.when(frame, visible, &|| body(key))
        })
    }

    /// Emits `body` where `condition` holds, and goes on after it either way.
    fn when(&self, frame: &Frame<'ctx>, condition: IntValue<'ctx>, body: &dyn Fn() -> Gen<()>) -> Gen<()> {
        self.branch(frame, condition, body, &|| Ok(()))
    }

    /// Emits `then` where `condition` holds and `otherwise` where it does not, and goes on after
    /// either.
    fn branch(
        &self,
        frame: &Frame<'ctx>,
        condition: IntValue<'ctx>,
        then: &dyn Fn() -> Gen<()>,
        otherwise: &dyn Fn() -> Gen<()>,
    ) -> Gen<()> {
        let (then_block, otherwise_block, after) = (
            self.context.append_basic_block(frame.function, "then"),
            self.context.append_basic_block(frame.function, "otherwise"),
            self.context.append_basic_block(frame.function, "after"),
        );
        self.builder.build_conditional_branch(condition, then_block, otherwise_block)?;
        for (block, body) in [(then_block, then), (otherwise_block, otherwise)] {
            self.builder.position_at_end(block);
            body()?;
            self.builder.build_unconditional_branch(after)?;
        }
        self.builder.position_at_end(after);
        Ok(())
    }

    /// Writes zeros into `len` elements of `out` from `base`.
    fn write_zeros(&self, frame: &Frame<'ctx>, out: Operand<'ctx>, base: IntValue<'ctx>, len: u64) -> Gen<()> {
        self.for_each(frame, len, |offset| {
            let at = self.builder.build_int_nuw_add(base, offset, "zero_at")?;
            self.write(out, at, self.f32_type.const_float(0.0))
        })
    }

    /// One key's step of an online softmax: its `score` moves the running maximum at `max` and
    /// the running sum at `sum`; returns the factor that rescales what was summed before, and the
    /// key's own weight `exp(score - max)`.
    fn softmax_step(
        &self,
        max: PointerValue<'ctx>,
        sum: PointerValue<'ctx>,
        score: FloatValue<'ctx>,
    ) -> Gen<(FloatValue<'ctx>, FloatValue<'ctx>)> {
        let old_max = self.builder.build_load(self.f32_type, max, "old_max")?.into_float_value();
        let new_max = self.call_binary_float("llvm.maxnum", old_max, score)?;
        // exp(-inf) = 0 drops the empty history at a row's first visible key.
        let correction = self.exp(self.builder.build_float_sub(old_max, new_max, "shift")?)?;
        let weight = self.exp(self.builder.build_float_sub(score, new_max, "centered")?)?;
        let old_sum = self.builder.build_load(self.f32_type, sum, "old_sum")?.into_float_value();
        let rescaled = self.builder.build_float_mul(old_sum, correction, "rescaled_sum")?;
        self.builder.build_store(sum, self.builder.build_float_add(rescaled, weight, "sum")?)?;
        self.builder.build_store(max, new_max)?;
        Ok((correction, weight))
    }

    /// `Σ a[a_base + d] · b[b_base + d]` over a head's width.
    fn head_dot(
        &self,
        frame: &Frame<'ctx>,
        (a, a_base): (Operand<'ctx>, IntValue<'ctx>),
        (b, b_base): (Operand<'ctx>, IntValue<'ctx>),
        head_dim: u64,
    ) -> Gen<FloatValue<'ctx>> {
        self.fold(frame, head_dim, self.f32_type.const_float(0.0), |dim, total| {
            let a_at = self.builder.build_int_nuw_add(a_base, dim, "a_at")?;
            let b_at = self.builder.build_int_nuw_add(b_base, dim, "b_at")?;
            let product = self.builder.build_float_mul(self.read(a, a_at)?, self.read(b, b_at)?, "product")?;
            Ok(self.builder.build_float_add(total, product, "dot")?)
        })
    }

    /// Merges two attention states over disjoint key sets (rows of `head_dim` outputs then the
    /// log-sum-exp, as attention with its log-sum-exp writes them), one row an item, by their
    /// log-sum-exp weights as the runtime's `merge_attention` does: a row neither side saw stays
    /// zeros and `-inf`.
    fn merge_attention(&self, frame: &Frame<'ctx>, rows: u64, head_dim: u64) -> Gen<()> {
        let (first, second, out) = (frame.inputs[0], frame.inputs[1], frame.outs[0]);
        let width = head_dim + 1;
        let zero = self.f32_type.const_float(0.0);
        self.parallel(frame, rows, |row| {
            let base = self.builder.build_int_mul(row, self.index(width), "base")?;
            let lse_at = self.builder.build_int_nuw_add(base, self.index(head_dim), "lse_at")?;
            let (first_lse, second_lse) = (self.read(first, lse_at)?, self.read(second, lse_at)?);
            let max = self.call_binary_float("llvm.maxnum", first_lse, second_lse)?;
            let negative_infinity = self.f32_type.const_float(f64::NEG_INFINITY);
            let seen = self.builder.build_float_compare(FloatPredicate::ONE, max, negative_infinity, "seen")?;
            // Shifted by 0 where neither side saw a key, so that no NaN is made; the row is then
            // written as zeros and -inf below. exp(-inf) = 0 drops a side that saw nothing.
            let shift = self.builder.build_select(seen, max, zero, "shift")?.into_float_value();
            let first_weight = self.exp(self.builder.build_float_sub(first_lse, shift, "first_shifted")?)?;
            let second_weight = self.exp(self.builder.build_float_sub(second_lse, shift, "second_shifted")?)?;
            let total = self.builder.build_float_add(first_weight, second_weight, "total")?;
            let first_weight = self.builder.build_float_div(first_weight, total, "first_weight")?;
            let second_weight = self.builder.build_float_div(second_weight, total, "second_weight")?;
            let first_weight = self.builder.build_select(seen, first_weight, zero, "first_weight")?.into_float_value();
            let second_weight =
                self.builder.build_select(seen, second_weight, zero, "second_weight")?.into_float_value();
            self.for_each(frame, head_dim, |dim| {
                let at = self.builder.build_int_nuw_add(base, dim, "at")?;
                let left = self.builder.build_float_mul(first_weight, self.read(first, at)?, "left")?;
                let right = self.builder.build_float_mul(second_weight, self.read(second, at)?, "right")?;
                self.write(out, at, self.builder.build_float_add(left, right, "merged")?)
            })?;
            let lse = self.builder.build_float_add(max, self.ln(total)?, "lse")?;
            let lse = self.builder.build_select(seen, lse, negative_infinity, "lse")?.into_float_value();
            self.write(out, lse_at, lse)
        })
    }

    /// A vocabulary-parallel embedding lookup, one output element an item: row `t` of the output is
    /// the token's row where this shard (`rows` rows from `vocab_offset`) holds it, zeros
    /// elsewhere. Token ids past the vocabulary are the runtime's to refuse before the launch.
    fn embedding(&self, frame: &Frame<'ctx>, tokens: u64, hidden: u64, vocab_offset: u64, rows: u64) -> Gen<()> {
        let (table, token_ids, out) = (frame.inputs[0], frame.inputs[1], frame.outs[0]);
        self.parallel(frame, tokens * hidden, |index| {
            let token_index = self.builder.build_int_unsigned_div(index, self.index(hidden), "token_index")?;
            let column = self.builder.build_int_unsigned_rem(index, self.index(hidden), "column")?;
            let token = self.load_u32(token_ids.pointer, token_index)?;
            // Below the shard the subtraction wraps past `rows`: one comparison covers both sides.
            let local_row = self.builder.build_int_sub(token, self.index(vocab_offset), "local_row")?;
            let held = self.builder.build_int_compare(IntPredicate::ULT, local_row, self.index(rows), "held")?;
            let copy = || {
                let source = self.builder.build_int_mul(local_row, self.index(hidden), "source")?;
                let source = self.builder.build_int_nuw_add(source, column, "source")?;
                self.write(out, index, self.read(table, source)?)
            };
            self.branch(frame, held, &copy, &|| self.write(out, index, self.f32_type.const_float(0.0)))
        })
    }

    /// `position * inv_freq[pair]`, one f32 product as the runtime computes it.
    fn angle(
        &self,
        position: FloatValue<'ctx>,
        frequencies: PointerValue<'ctx>,
        pair: IntValue<'ctx>,
    ) -> Gen<FloatValue<'ctx>> {
        Ok(self.builder.build_float_mul(position, self.load(frequencies, pair)?, "angle")?)
    }

    /// The angle reduced to [-π, π] in f64 (the GPU's approximate sine is accurate only there).
    fn reduce_angle(&self, angle: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let tau = std::f64::consts::TAU;
        let wide = self.builder.build_float_ext(angle, self.f64_type, "angle_f64")?;
        let turns = self.builder.build_float_mul(wide, self.f64_type.const_float(1.0 / tau), "turns")?;
        let whole = self.call_float("llvm.rint", turns)?;
        let offset = self.builder.build_float_mul(whole, self.f64_type.const_float(tau), "offset")?;
        let reduced = self.builder.build_float_sub(wide, offset, "reduced")?;
        Ok(self.builder.build_float_trunc(reduced, self.f32_type, "reduced_f32")?)
    }

    /// `exp(value)` for f32: libm's `expf` on the host, `ex2.approx` on the GPU.
    fn exp(&self, value: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        match self.flavor {
            // The C library's `expf`, which the runtime's kernel calls too (so the values agree bit
            // for bit), called as a function that may set errno: LLVM keeps the loop scalar.
            // Through `llvm.exp` it vectorizes the loop and then calls `expf` lane by lane with
            // a spill and a shuffle each, slower than the scalar loop (measured: 15 ms against
            // 13 ms for SiLU-mul over 2048 x 2816).
            Flavor::Host => self.call_libm("expf", value),
            Flavor::Ptx => {
                let log2_e = self.f32_type.const_float(std::f64::consts::LOG2_E);
                let scaled = self.builder.build_float_mul(value, log2_e, "exponent")?;
                self.call_nvvm("llvm.nvvm.ex2.approx.f", scaled)
            }
        }
    }

    /// `ln(value)` for f32: libm's `logf` on the host, `lg2.approx` times ln 2 on the GPU.
    fn ln(&self, value: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        match self.flavor {
            Flavor::Host => self.call_libm("logf", value),
            Flavor::Ptx => {
                let log2 = self.call_nvvm("llvm.nvvm.lg2.approx.f", value)?;
                Ok(self.builder.build_float_mul(log2, self.f32_type.const_float(std::f64::consts::LN_2), "ln")?)
            }
        }
    }

    // === Loops ===

    /// `body(index)` for each `index` below `items`: a loop on the host, one thread an item on the
    /// GPU (threads past the end do nothing).
    fn parallel(&self, frame: &Frame<'ctx>, items: u64, body: impl FnOnce(IntValue<'ctx>) -> Gen<()>) -> Gen<()> {
        self.items.set(items);
        match self.flavor {
            Flavor::Host => self.for_each(frame, items, body),
            Flavor::Ptx => {
                let read = |name: &str| -> Gen<IntValue<'ctx>> {
                    let function = self.intrinsic(name, &[])?;
                    let value = self.call(function, &[])?.into_int_value();
                    Ok(self.builder.build_int_z_extend(value, self.i64_type, "sreg")?)
                };
                let (block, width, thread) = (
                    read("llvm.nvvm.read.ptx.sreg.ctaid.x")?,
                    read("llvm.nvvm.read.ptx.sreg.ntid.x")?,
                    read("llvm.nvvm.read.ptx.sreg.tid.x")?,
                );
                let first = self.builder.build_int_mul(block, width, "block_start")?;
                let index = self.builder.build_int_nuw_add(first, thread, "item")?;
                let in_range =
                    self.builder.build_int_compare(IntPredicate::ULT, index, self.index(items), "in_range")?;
                let work = self.context.append_basic_block(frame.function, "work");
                let done = self.context.append_basic_block(frame.function, "done");
                self.builder.build_conditional_branch(in_range, work, done)?;
                self.builder.position_at_end(work);
                body(index)?;
                self.builder.build_unconditional_branch(done)?;
                self.builder.position_at_end(done);
                Ok(())
            }
        }
    }

    /// `body(index)` for each `index` below `count`.
    fn for_each(&self, frame: &Frame<'ctx>, count: u64, body: impl FnOnce(IntValue<'ctx>) -> Gen<()>) -> Gen<()> {
        self.counted_loop(frame, count, None, |index, _| body(index).map(|()| None)).map(|_| ())
    }

    /// Folds `body(index, accumulator)` over each `index` below `count`, starting from `init`.
    fn fold(
        &self,
        frame: &Frame<'ctx>,
        count: u64,
        init: FloatValue<'ctx>,
        body: impl FnOnce(IntValue<'ctx>, FloatValue<'ctx>) -> Gen<FloatValue<'ctx>>,
    ) -> Gen<FloatValue<'ctx>> {
        let result = self.counted_loop(frame, count, Some(init), |index, accumulator| {
            let accumulator =
                accumulator.ok_or(LlvmError::Builder { message: "a fold lost its accumulator".into() })?;
            body(index, accumulator).map(Some)
        })?;
        Ok(result.unwrap_or(init))
    }

    /// A bottom-tested loop over `0..count` (skipped when `count` is 0), carrying an optional f32/f64
    /// accumulator; returns the accumulator's final value.
    fn counted_loop(
        &self,
        frame: &Frame<'ctx>,
        count: u64,
        init: Option<FloatValue<'ctx>>,
        body: impl FnOnce(IntValue<'ctx>, Option<FloatValue<'ctx>>) -> Gen<Option<FloatValue<'ctx>>>,
    ) -> Gen<Option<FloatValue<'ctx>>> {
        if count == 0 {
            return Ok(init);
        }
        let preheader = self.current_block()?;
        let header = self.context.append_basic_block(frame.function, "loop");
        let exit = self.context.append_basic_block(frame.function, "loop_end");
        self.builder.build_unconditional_branch(header)?;
        self.builder.position_at_end(header);
        let index = self.builder.build_phi(self.i64_type, "i")?;
        index.add_incoming(&[(&self.i64_type.const_zero(), preheader)]);
        let accumulator = match init {
            Some(init) => {
                let phi = self.builder.build_phi(init.get_type(), "accumulator")?;
                phi.add_incoming(&[(&init, preheader)]);
                Some(phi)
            }
            None => None,
        };
        let index_value = index.as_basic_value().into_int_value();
        let next_accumulator = body(index_value, accumulator.map(|phi| phi.as_basic_value().into_float_value()))?;
        let next = self.builder.build_int_nuw_add(index_value, self.index(1), "next")?;
        let latch = self.current_block()?;
        index.add_incoming(&[(&next, latch)]);
        if let (Some(phi), Some(value)) = (accumulator, next_accumulator) {
            phi.add_incoming(&[(&value, latch)]);
        }
        let more = self.builder.build_int_compare(IntPredicate::ULT, next, self.index(count), "more")?;
        self.builder.build_conditional_branch(more, header, exit)?;
        self.builder.position_at_end(exit);
        Ok(next_accumulator)
    }

    fn current_block(&self) -> Gen<inkwell::basic_block::BasicBlock<'ctx>> {
        self.builder.get_insert_block().ok_or(LlvmError::Builder { message: "the builder has no block".into() })
    }

    // === Memory and calls ===

    fn index(&self, value: u64) -> IntValue<'ctx> {
        self.i64_type.const_int(value, false)
    }

    /// `&base[index]` for elements of `element_type`.
    fn element(
        &self,
        element_type: BasicTypeEnum<'ctx>,
        base: PointerValue<'ctx>,
        index: IntValue<'ctx>,
    ) -> Gen<PointerValue<'ctx>> {
        // SAFETY: builds a GEP instruction; it dereferences nothing here. The kernels index within
        // the sizes `native_kernels` checked against the buffer table.
        Ok(unsafe { self.builder.build_in_bounds_gep(element_type, base, &[index], "at")? })
    }

    fn load(&self, base: PointerValue<'ctx>, index: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let slot = self.element(self.f32_type.into(), base, index)?;
        Ok(self.builder.build_load(self.f32_type, slot, "value")?.into_float_value())
    }

    /// `operand[index]` as f32, widened from bf16 where the operand holds bf16.
    fn read(&self, operand: Operand<'ctx>, index: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        if !operand.bf16 {
            return self.load(operand.pointer, index);
        }
        let i16_type = self.context.i16_type();
        let slot = self.element(i16_type.into(), operand.pointer, index)?;
        let bits = self.builder.build_load(i16_type, slot, "bf16")?.into_int_value();
        self.widen_bf16(bits)
    }

    /// Stores `value` at `operand[index]`, rounded to bf16 where the operand holds bf16.
    fn write(&self, operand: Operand<'ctx>, index: IntValue<'ctx>, value: FloatValue<'ctx>) -> Gen<()> {
        if !operand.bf16 {
            return self.store(operand.pointer, index, value);
        }
        let bits = self.bf16_bits(value)?;
        let slot = self.element(self.context.i16_type().into(), operand.pointer, index)?;
        self.builder.build_store(slot, bits)?;
        Ok(())
    }

    /// `value` as the runtime stores it in `operand`'s buffer: what a later instruction reads
    /// (rounded through bf16 for a bf16 buffer, even where this call receives it widened).
    fn as_stored(&self, operand: Operand<'ctx>, value: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        if !operand.stored_bf16 {
            return Ok(value);
        }
        self.widen_bf16(self.bf16_bits(value)?)
    }

    /// A bf16's 16 bits as the f32 of the same value (exact).
    fn widen_bf16(&self, bits: IntValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let i32_type = self.context.i32_type();
        let wide = self.builder.build_int_z_extend(bits, i32_type, "bf16_bits")?;
        let shifted = self.builder.build_left_shift(wide, i32_type.const_int(16, false), "f32_bits")?;
        Ok(self.builder.build_bit_cast(shifted, self.f32_type, "widened")?.into_float_value())
    }

    /// `value` rounded to bf16, as 16 bits: to nearest, ties to even, a NaN kept a quiet NaN, as
    /// the `half` crate's `bf16::from_f32` rounds (the host runtime's bf16 storage). Integer
    /// arithmetic, so that the host and a GPU round alike without a conversion instruction.
    fn bf16_bits(&self, value: FloatValue<'ctx>) -> Gen<IntValue<'ctx>> {
        let i32_type = self.context.i32_type();
        let constant = |bits: u64| i32_type.const_int(bits, false);
        let bits = self.builder.build_bit_cast(value, i32_type, "f32_bits")?.into_int_value();
        let magnitude = self.builder.build_and(bits, constant(0x7fff_ffff), "magnitude")?;
        let is_nan = self.builder.build_int_compare(IntPredicate::UGT, magnitude, constant(0x7f80_0000), "is_nan")?;
        let high = self.builder.build_right_shift(bits, constant(16), false, "high")?;
        let quiet_nan = self.builder.build_or(high, constant(0x40), "quiet_nan")?;
        // Up when the first dropped bit is set and either a later dropped bit or the kept low bit
        // is (`bits & 0x17fff`: bit 16 and bits 0 to 14).
        let halfway_or_more = self.builder.build_and(bits, constant(0x8000), "round_bit")?;
        let halfway_or_more =
            self.builder.build_int_compare(IntPredicate::NE, halfway_or_more, constant(0), "halfway_or_more")?;
        let beyond_or_odd = self.builder.build_and(bits, constant(0x1_7fff), "sticky_or_odd")?;
        let beyond_or_odd =
            self.builder.build_int_compare(IntPredicate::NE, beyond_or_odd, constant(0), "beyond_or_odd")?;
        let round_up = self.builder.build_and(halfway_or_more, beyond_or_odd, "round_up")?;
        let round_up = self.builder.build_int_z_extend(round_up, i32_type, "increment")?;
        let rounded = self.builder.build_int_add(high, round_up, "rounded")?;
        let result = self.builder.build_select(is_nan, quiet_nan, rounded, "bf16_or_nan")?.into_int_value();
        Ok(self.builder.build_int_truncate(result, self.context.i16_type(), "bf16")?)
    }

    /// `base[index]` for `u32` elements, widened to the index type.
    fn load_u32(&self, base: PointerValue<'ctx>, index: IntValue<'ctx>) -> Gen<IntValue<'ctx>> {
        let i32_type = self.context.i32_type();
        let slot = self.element(i32_type.into(), base, index)?;
        let value = self.builder.build_load(i32_type, slot, "u32")?.into_int_value();
        Ok(self.builder.build_int_z_extend(value, self.i64_type, "widened")?)
    }

    fn store(&self, base: PointerValue<'ctx>, index: IntValue<'ctx>, value: FloatValue<'ctx>) -> Gen<()> {
        let slot = self.element(self.f32_type.into(), base, index)?;
        self.builder.build_store(slot, value)?;
        Ok(())
    }

    /// A private constant `[f32; n]` global.
    fn constant_table(&self, name: &str, values: &[f32]) -> Gen<PointerValue<'ctx>> {
        let elements: Vec<FloatValue> = values.iter().map(|&value| self.f32_type.const_float(value as f64)).collect();
        let global = self.module.add_global(self.f32_type.array_type(values.len() as u32), None, name);
        global.set_initializer(&self.f32_type.const_array(&elements));
        global.set_constant(true);
        global.set_linkage(Linkage::Private);
        Ok(global.as_pointer_value())
    }

    fn intrinsic(&self, name: &str, types: &[BasicTypeEnum<'ctx>]) -> Gen<FunctionValue<'ctx>> {
        Intrinsic::find(name)
            .and_then(|intrinsic| intrinsic.get_declaration(self.module, types))
            .ok_or_else(|| LlvmError::Intrinsic { name: name.to_string() })
    }

    /// Calls the overloaded float intrinsic `name` at the argument's type.
    fn call_float(&self, name: &str, argument: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let function = self.intrinsic(name, &[argument.get_type().into()])?;
        Ok(self.call(function, &[argument.into()])?.into_float_value())
    }

    /// Calls the overloaded two-argument float intrinsic `name` (`llvm.maxnum`) at the arguments' type.
    fn call_binary_float(&self, name: &str, left: FloatValue<'ctx>, right: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let function = self.intrinsic(name, &[left.get_type().into()])?;
        Ok(self.call(function, &[left.into(), right.into()])?.into_float_value())
    }

    /// Calls the C math library's one-argument function `name` (`expf`, `cos`, ...) on `argument`,
    /// declared as a plain function (which may set errno), not as an LLVM intrinsic: see `exp`.
    fn call_libm(&self, name: &str, argument: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let float = argument.get_type();
        let function = self
            .module
            .get_function(name)
            .unwrap_or_else(|| self.module.add_function(name, float.fn_type(&[float.into()], false), None));
        Ok(self.call(function, &[argument.into()])?.into_float_value())
    }

    /// Calls the non-overloaded f32 NVVM intrinsic `name`.
    fn call_nvvm(&self, name: &str, argument: FloatValue<'ctx>) -> Gen<FloatValue<'ctx>> {
        let function = self.intrinsic(name, &[])?;
        Ok(self.call(function, &[argument.into()])?.into_float_value())
    }

    fn call(
        &self,
        function: FunctionValue<'ctx>,
        arguments: &[BasicMetadataValueEnum<'ctx>],
    ) -> Gen<inkwell::values::BasicValueEnum<'ctx>> {
        match self.builder.build_call(function, arguments, "call")?.try_as_basic_value() {
            ValueKind::Basic(value) => Ok(value),
            ValueKind::Instruction(_) => Err(LlvmError::Builder {
                message: format!("{} returns nothing", function.get_name().to_string_lossy()),
            }),
        }
    }
}
