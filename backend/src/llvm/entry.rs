//! A rank's entry function, `int32_t pleat_rank_main(void* ctx)`: the whole program, in order, as
//! straight-line code. Each instruction with a generated kernel calls that kernel directly (LLVM may
//! inline it), between `pleat_rt_begin` and `pleat_rt_end`, with its operands' and results' data
//! from `pleat_rt_operand` and `pleat_rt_result`; every other instruction is one call of the
//! runtime's C ABI with the instruction's constants as arguments (`crate::native::abi`): sizes and
//! ids as immediates, regions, shapes, names, groups and frequency tables as private constant
//! arrays.
//!
//! Every call's status (or pointer) is checked: the first failure returns `STATUS_ERROR` at once,
//! so the runtime's error comes back from the entry function. Kernels are called directly only when
//! every buffer they touch is stored as f32 or u32 (a bf16 buffer's instruction goes through the
//! runtime, which widens and rounds as the bytecode path does).

use std::collections::{HashMap, HashSet};

use inkwell::attributes::{Attribute, AttributeLoc};
use inkwell::basic_block::BasicBlock;
use inkwell::builder::Builder;
use inkwell::context::Context;
use inkwell::module::{Linkage, Module};
use inkwell::types::{BasicMetadataTypeEnum, BasicType, BasicTypeEnum};
use inkwell::values::{
    ArrayValue, BasicMetadataValueEnum, BasicValueEnum, FunctionValue, IntValue, PointerValue, ValueKind,
};
use inkwell::{AddressSpace, IntPredicate};

use crate::native::abi::{
    runtime_call, AbiArg, BEGIN_SYMBOL, END_SYMBOL, ENTRY_SYMBOL, EXE_MAIN_SYMBOL, OPERAND_SYMBOL, RESULT_SYMBOL,
    STATUS_ERROR, STATUS_OK,
};
use crate::native::{native_kernels, NativeKernel};
use crate::program::{BufferId, Instr, Program};
use pleat_ir::DType;

use super::LlvmError;

type Gen<T> = Result<T, LlvmError>;

/// The most operands a generated kernel reads (a fused add + norm: two addends and a weight).
const MAX_KERNEL_OPERANDS: u32 = 3;

/// Defines a rank executable's `int main(int argc, char** argv)` in `module`, which holds the entry
/// function and the fingerprint function: it returns
/// `pleat_rt_exe_main(argc, argv, rank, pleat_rank_main, pleat_program_fingerprint)`, the static
/// runtime's main (`pleat-rt`), which runs the rank as an MPI process.
pub(crate) fn define_main<'ctx>(context: &'ctx Context, module: &Module<'ctx>, rank: u32) -> Gen<()> {
    let missing = |symbol: &str| LlvmError::Builder { message: format!("the module has no function {symbol}") };
    let entry = module.get_function(ENTRY_SYMBOL).ok_or_else(|| missing(ENTRY_SYMBOL))?;
    let fingerprint = module
        .get_function(crate::native::FINGERPRINT_SYMBOL)
        .ok_or_else(|| missing(crate::native::FINGERPRINT_SYMBOL))?;
    let i32_type = context.i32_type();
    let ptr_type = context.ptr_type(AddressSpace::default());
    let exe_main = module.add_function(
        EXE_MAIN_SYMBOL,
        i32_type.fn_type(&[i32_type.into(), ptr_type.into(), i32_type.into(), ptr_type.into(), ptr_type.into()], false),
        Some(Linkage::External),
    );
    let main = module.add_function("main", i32_type.fn_type(&[i32_type.into(), ptr_type.into()], false), None);
    let (Some(argc), Some(argv)) = (main.get_nth_param(0), main.get_nth_param(1)) else {
        return Err(LlvmError::Builder { message: "main has no argc, argv".into() });
    };
    let builder = context.create_builder();
    builder.position_at_end(context.append_basic_block(main, "entry"));
    let status = builder
        .build_call(
            exe_main,
            &[
                argc.into(),
                argv.into(),
                i32_type.const_int(u64::from(rank), false).into(),
                entry.as_global_value().as_pointer_value().into(),
                fingerprint.as_global_value().as_pointer_value().into(),
            ],
            "status",
        )?
        .try_as_basic_value();
    let ValueKind::Basic(status) = status else {
        return Err(LlvmError::Builder { message: format!("{EXE_MAIN_SYMBOL} returns nothing") });
    };
    builder.build_return(Some(&status))?;
    Ok(())
}

/// Builds the entry function into a module that already defines `program`'s kernels.
pub(crate) struct EntryCodegen<'ctx, 'module> {
    context: &'ctx Context,
    module: &'module Module<'ctx>,
    builder: Builder<'ctx>,
    /// The `void* ctx` parameter.
    runtime_context: PointerValue<'ctx>,
    /// Returns `STATUS_ERROR`.
    fail: BasicBlock<'ctx>,
    /// The array of operand pointers a kernel call takes.
    operand_array: PointerValue<'ctx>,
}

/// Defines `pleat_rank_main` for `program` in `module`, which holds `program`'s kernels.
pub(crate) fn define_entry<'ctx>(
    context: &'ctx Context,
    module: &Module<'ctx>,
    program: &Program,
) -> Gen<FunctionValue<'ctx>> {
    let i32_type = context.i32_type();
    let ptr_type = context.ptr_type(AddressSpace::default());
    let function = module.add_function(ENTRY_SYMBOL, i32_type.fn_type(&[ptr_type.into()], false), None);
    let runtime_context = function
        .get_nth_param(0)
        .ok_or(LlvmError::Builder { message: "the entry function has no parameter".into() })?
        .into_pointer_value();
    runtime_context.set_name("ctx");
    let builder = context.create_builder();
    let start = context.append_basic_block(function, "entry");
    let fail = context.append_basic_block(function, "fail");
    builder.position_at_end(fail);
    builder.build_return(Some(&i32_type.const_int(STATUS_ERROR as u64, false)))?;
    builder.position_at_end(start);
    let operand_array = builder.build_alloca(ptr_type.array_type(MAX_KERNEL_OPERANDS), "operands")?;
    let codegen = EntryCodegen { context, module, builder, runtime_context, fail, operand_array };
    codegen.walk(program)?;
    Ok(function)
}

impl<'ctx> EntryCodegen<'ctx, '_> {
    fn walk(&self, program: &Program) -> Gen<()> {
        let direct: HashMap<usize, NativeKernel> = native_kernels(program)
            .into_iter()
            .filter(|kernel| stored_as_f32_or_u32(program, kernel))
            .map(|kernel| (kernel.first_instr(), kernel))
            .collect();
        let fused_norms: HashSet<usize> = direct
            .values()
            .filter_map(|kernel| match kernel {
                NativeKernel::FusedAddRmsNorm { norm_instr, .. } => Some(*norm_instr),
                NativeKernel::Single { .. } => None,
            })
            .collect();
        for (index, instr) in program.instructions.iter().enumerate() {
            if let Some(kernel) = direct.get(&index) {
                self.kernel_call(program, index, kernel)?;
            } else if fused_norms.contains(&index) {
                // The fused kernel at the add already wrote this norm's result.
                self.bracket(BEGIN_SYMBOL, index)?;
                self.bracket(END_SYMBOL, index)?;
            } else {
                self.runtime_instruction(index, instr)?;
            }
        }
        self.builder.build_return(Some(&self.context.i32_type().const_int(STATUS_OK as u64, false)))?;
        Ok(())
    }

    /// Runs a generated kernel: its operands, its result(s), the call.
    fn kernel_call(&self, program: &Program, index: usize, kernel: &NativeKernel) -> Gen<()> {
        let (operands, results) = kernel_buffers(program, kernel)?;
        self.bracket(BEGIN_SYMBOL, index)?;
        let ptr_type = self.context.ptr_type(AddressSpace::default());
        for (slot, &operand) in operands.iter().enumerate() {
            let data = self.checked_pointer(program, OPERAND_SYMBOL, index, operand, &format!("operand{slot}"))?;
            // SAFETY: a GEP within the operand array, sized for MAX_KERNEL_OPERANDS.
            let at = unsafe {
                self.builder.build_in_bounds_gep(
                    ptr_type.array_type(MAX_KERNEL_OPERANDS),
                    self.operand_array,
                    &[self.i64(0), self.i64(slot as u64)],
                    "slot",
                )?
            };
            self.builder.build_store(at, data)?;
        }
        let mut arguments: Vec<BasicMetadataValueEnum> = vec![self.operand_array.into()];
        for (slot, &result) in results.iter().enumerate() {
            let data = self.checked_pointer(program, RESULT_SYMBOL, index, result, &format!("result{slot}"))?;
            arguments.push(data.into());
        }
        let function =
            self.module.get_function(&kernel.symbol()).ok_or(LlvmError::NotAKernel { instr: kernel.first_instr() })?;
        self.builder.build_call(function, &arguments, "")?;
        self.bracket(END_SYMBOL, index)
    }

    /// `pleat_rt_begin` or `pleat_rt_end` for instruction `index`, checked.
    fn bracket(&self, symbol: &str, index: usize) -> Gen<()> {
        let function = self.runtime_function(symbol, &[], self.context.i32_type().into())?;
        let status = self.call_value(function, &[self.runtime_context.into(), self.i64(index as u64).into()])?;
        let stage = if symbol == BEGIN_SYMBOL { "begun" } else { "done" };
        self.check_status(status.into_int_value(), &format!("instr{index}.{stage}"))
    }

    /// `pleat_rt_operand` or `pleat_rt_result` for `buffer`, with the element count the kernel reads
    /// or writes (the program's, which the runtime checks), branching to the failure on null.
    fn checked_pointer(
        &self,
        program: &Program,
        symbol: &str,
        index: usize,
        buffer: BufferId,
        name: &str,
    ) -> Gen<PointerValue<'ctx>> {
        let i32_type = self.context.i32_type();
        let ptr_type = self.context.ptr_type(AddressSpace::default());
        let function =
            self.runtime_function(symbol, &[i32_type.into(), self.context.i64_type().into()], ptr_type.into())?;
        let arguments = [
            self.runtime_context.into(),
            self.i64(index as u64).into(),
            i32_type.const_int(u64::from(buffer.as_u32()), false).into(),
            self.i64(program.buffer(buffer).numel()).into(),
        ];
        let pointer = self.call_value(function, &arguments)?.into_pointer_value();
        pointer.set_name(name);
        let is_null = self.builder.build_is_null(pointer, "is_null")?;
        self.branch_unless(is_null, &format!("instr{index}.{name}.ready"))?;
        Ok(pointer)
    }

    /// One runtime call for `instr`, with its constants as arguments.
    fn runtime_instruction(&self, index: usize, instr: &Instr) -> Gen<()> {
        let call = runtime_call(instr);
        let mut types: Vec<BasicMetadataTypeEnum> = Vec::new();
        let mut arguments: Vec<BasicMetadataValueEnum> =
            vec![self.runtime_context.into(), self.i64(index as u64).into()];
        for (position, argument) in call.args.iter().enumerate() {
            for value in self.marshal(argument, &format!("instr{index}.arg{position}"))? {
                types.push(value.get_type().into());
                arguments.push(value.into());
            }
        }
        let function = self.runtime_function(call.symbol, &types, self.context.i32_type().into())?;
        let status = self.call_value(function, &arguments)?;
        self.check_status(status.into_int_value(), &format!("instr{index}.done"))
    }

    /// An ABI argument as its C parameters (see `AbiArg`).
    fn marshal(&self, argument: &AbiArg, name: &str) -> Gen<Vec<BasicValueEnum<'ctx>>> {
        let i32_type = self.context.i32_type();
        let i64_type = self.context.i64_type();
        let counted = |array: Option<ArrayValue<'ctx>>, count: usize| -> Vec<BasicValueEnum<'ctx>> {
            let pointer = match array {
                Some(array) if count > 0 => self.constant_array(array, name),
                _ => self.context.ptr_type(AddressSpace::default()).const_null(),
            };
            vec![pointer.into(), self.i64(count as u64).into()]
        };
        Ok(match argument {
            AbiArg::Buffer(id) => vec![i32_type.const_int(u64::from(id.as_u32()), false).into()],
            AbiArg::Buffers(ids) => {
                let values: Vec<IntValue> =
                    ids.iter().map(|id| i32_type.const_int(u64::from(id.as_u32()), false)).collect();
                counted(Some(i32_type.const_array(&values)), ids.len())
            }
            AbiArg::U64(value) => vec![self.i64(*value).into()],
            AbiArg::F64(value) => vec![self.context.f64_type().const_float(*value).into()],
            AbiArg::F32(value) => vec![self.context.f32_type().const_float(f64::from(*value)).into()],
            AbiArg::Bool(value) => vec![i32_type.const_int(u64::from(*value), false).into()],
            AbiArg::U64s(values) => {
                let values: Vec<IntValue> = values.iter().map(|&value| i64_type.const_int(value, false)).collect();
                counted(Some(i64_type.const_array(&values)), values.len())
            }
            AbiArg::U32s(values) => {
                let values: Vec<IntValue> =
                    values.iter().map(|&value| i32_type.const_int(u64::from(value), false)).collect();
                counted(Some(i32_type.const_array(&values)), values.len())
            }
            AbiArg::F32s(values) => {
                let f32_type = self.context.f32_type();
                let values: Vec<_> = values.iter().map(|&value| f32_type.const_float(f64::from(value))).collect();
                counted(Some(f32_type.const_array(&values)), values.len())
            }
            AbiArg::Text(text) => counted(Some(self.context.const_string(text.as_bytes(), false)), text.len()),
        })
    }

    /// A private, unnamed-address constant global holding `array`.
    fn constant_array(&self, array: ArrayValue<'ctx>, name: &str) -> PointerValue<'ctx> {
        let global = self.module.add_global(array.get_type(), None, name);
        global.set_initializer(&array);
        global.set_constant(true);
        global.set_linkage(Linkage::Private);
        global.set_unnamed_addr(true);
        global.as_pointer_value()
    }

    /// The declaration of runtime function `symbol(void* ctx, uint64_t instr, extra...)`.
    fn runtime_function(
        &self,
        symbol: &str,
        extra: &[BasicMetadataTypeEnum<'ctx>],
        returns: BasicTypeEnum<'ctx>,
    ) -> Gen<FunctionValue<'ctx>> {
        if let Some(function) = self.module.get_function(symbol) {
            return Ok(function);
        }
        let mut parameters: Vec<BasicMetadataTypeEnum> =
            vec![self.context.ptr_type(AddressSpace::default()).into(), self.context.i64_type().into()];
        parameters.extend_from_slice(extra);
        let function_type = returns.fn_type(&parameters, false);
        let function = self.module.add_function(symbol, function_type, Some(Linkage::External));
        // The runtime catches every panic: no unwinding leaves a `pleat_rt_*` function.
        let nounwind = self.context.create_enum_attribute(Attribute::get_named_enum_kind_id("nounwind"), 0);
        function.add_attribute(AttributeLoc::Function, nounwind);
        Ok(function)
    }

    fn call_value(
        &self,
        function: FunctionValue<'ctx>,
        arguments: &[BasicMetadataValueEnum<'ctx>],
    ) -> Gen<BasicValueEnum<'ctx>> {
        match self.builder.build_call(function, arguments, "status")?.try_as_basic_value() {
            ValueKind::Basic(value) => Ok(value),
            ValueKind::Instruction(_) => Err(LlvmError::Builder {
                message: format!("{} returns nothing", function.get_name().to_string_lossy()),
            }),
        }
    }

    /// Continues (in a block named `next`) when `status` is `STATUS_OK`; returns the failure otherwise.
    fn check_status(&self, status: IntValue<'ctx>, next: &str) -> Gen<()> {
        let failed = self.builder.build_int_compare(
            IntPredicate::NE,
            status,
            self.context.i32_type().const_int(STATUS_OK as u64, false),
            "failed",
        )?;
        self.branch_unless(failed, next)
    }

    /// Branches to the failure when `failed`, and continues in a new block otherwise.
    fn branch_unless(&self, failed: IntValue<'ctx>, name: &str) -> Gen<()> {
        let next = self.context.insert_basic_block_after(self.current_block()?, name);
        self.builder.build_conditional_branch(failed, self.fail, next)?;
        self.builder.position_at_end(next);
        Ok(())
    }

    fn current_block(&self) -> Gen<BasicBlock<'ctx>> {
        self.builder.get_insert_block().ok_or(LlvmError::Builder { message: "no insertion block".into() })
    }

    fn i64(&self, value: u64) -> IntValue<'ctx> {
        self.context.i64_type().const_int(value, false)
    }
}

/// The buffers a generated kernel reads and writes, in its ABI's order.
fn kernel_buffers(program: &Program, kernel: &NativeKernel) -> Gen<(Vec<BufferId>, Vec<BufferId>)> {
    let kernel_at = |instr: usize| match program.instructions.get(instr) {
        Some(Instr::Kernel { inputs, out, .. }) => Ok((inputs.clone(), *out)),
        _ => Err(LlvmError::NotAKernel { instr }),
    };
    match kernel {
        NativeKernel::Single { instr } => {
            let (inputs, out) = kernel_at(*instr)?;
            Ok((inputs, vec![out]))
        }
        NativeKernel::FusedAddRmsNorm { add_instr, norm_instr } => {
            let (add_inputs, sum) = kernel_at(*add_instr)?;
            let (norm_inputs, normed) = kernel_at(*norm_instr)?;
            let weight = *norm_inputs.get(1).ok_or(LlvmError::NotAKernel { instr: *norm_instr })?;
            Ok((add_inputs.into_iter().chain([weight]).collect(), vec![sum, normed]))
        }
    }
}

/// Whether every buffer `kernel` touches is stored as f32 or u32 (not bf16), so that generated code
/// can read and write it in place.
fn stored_as_f32_or_u32(program: &Program, kernel: &NativeKernel) -> bool {
    kernel_buffers(program, kernel).is_ok_and(|(operands, results)| {
        operands
            .iter()
            .chain(&results)
            .all(|&id| program.buffers.get(id.as_u32() as usize).is_some_and(|buffer| buffer.dtype != DType::Bf16))
    })
}
