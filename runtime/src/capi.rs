//! The runtime's C ABI (`pleat_rt_*`, listed in `pleat_backend::native::abi`): what a rank
//! library's entry function (`pleat_rank_main`) calls for every instruction that has no generated
//! code, and [`execute_entry`], which runs a rank by calling that entry function.
//!
//! Guarantees:
//! - no panic crosses the FFI boundary: every function catches unwinding and returns
//!   `STATUS_ERROR` (or a null pointer), with the reason kept in the context; the entry function
//!   checks every status and returns at the first error, which [`execute_entry`] returns;
//! - a call runs only the instruction the program holds at its index, in program order, each once:
//!   the instruction rebuilt from the call's constants must equal the program's, so a library can
//!   never run anything its program does not say, and a run that skips an instruction is an error;
//! - each instruction runs through the executor's own step (`executor::Run`), so the values equal
//!   the bytecode path's bit for bit.
//!
//! An executable that loads rank libraries must export these symbols to them
//! (`-Wl,--export-dynamic-symbol=pleat_rt_*`, see the `pleat` binary's build script); [`execute_entry`]
//! references every function so that the linker keeps them.

use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};

use pleat_backend::native::abi::{STATUS_ERROR, STATUS_OK};
use pleat_backend::{
    AttentionDims, AttentionOperand, BufferId, Group, Instr, Kernel, MoeDims, Program, RouterDims, TransferStream,
};
use pleat_ir::entity::EntityRef;

use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::executor::{RankOutcome, Run, RunInputs};
use crate::native::{EntryFunction, NativeKernels};

/// What the C ABI's `void* ctx` points to: one rank's run and the first error it met.
pub struct RankContext<'a> {
    run: Run<'a>,
    /// The instruction the next call must be for.
    next_instr: usize,
    /// Whether the instruction `next_instr` has begun (its call is in progress).
    begun: bool,
    /// Check each call's instruction against the program without running it ([`verify_entry`]).
    check_only: bool,
    error: Option<Error>,
}

/// Runs `program` by calling the entry function of `library`, which must have been generated for
/// it (same fingerprint).
pub fn execute_entry(
    program: &Program,
    comm: &mut dyn Communicator,
    inputs: &RunInputs,
    gemm_threads: usize,
    library: &NativeKernels,
) -> Result<RankOutcome> {
    let entry = entry_for(program, library)?;
    execute_entry_function(program, comm, inputs, gemm_threads, entry)
}

/// Runs `program` by calling `entry`, the entry function generated for it (the caller has checked
/// the fingerprint: a rank executable's own, linked beside it by `pleat compile --emit exe`).
pub fn execute_entry_function(
    program: &Program,
    comm: &mut dyn Communicator,
    inputs: &RunInputs,
    gemm_threads: usize,
    entry: EntryFunction,
) -> Result<RankOutcome> {
    // The linker keeps (and the executable exports) only functions something references.
    std::hint::black_box(exported_functions());
    let drive = |run: Run<'_>| {
        let run = run.with_planned_arena();
        let context =
            call_entry(RankContext { run, next_instr: 0, begun: false, check_only: false, error: None }, entry)?;
        Ok(context.run.finish())
    };
    // A scheduled program's transfers run on the rank's communication streams from their
    // `pleat_rt_*` call to their `pleat_rt_wait`, as in the bytecode loop.
    if crate::executor::is_asynchronous(program) {
        if let Some(comm) = comm.as_sendable() {
            return crate::executor::run_streamed(program, comm, inputs, gemm_threads, drive);
        }
    }
    drive(Run::new(program, comm, inputs, gemm_threads)?)
}

/// Calls `entry` with every runtime call only checking its instruction against `program`, not
/// running it (the generated kernels run on zeroed stand-in operands); returns the instructions
/// checked. This proves that the library passes every instruction's constants so that the
/// runtime rebuilds exactly the program's instruction, for programs that cannot run here (a
/// training step's kernels, collectives of absent peers).
pub fn verify_entry(program: &Program, library: &NativeKernels) -> Result<usize> {
    std::hint::black_box(exported_functions());
    let entry = entry_for(program, library)?;
    let token_count = if program.tokens_shape.is_empty() { 0 } else { program.tokens_shape.iter().product::<u64>() };
    let seq = program.tokens_shape.get(1).copied().unwrap_or(0);
    let tokens = vec![0u32; token_count as usize];
    let positions: Vec<u32> = (0..seq as u32).collect();
    let weights = crate::weights::SeededWeights::new(0);
    let inputs =
        RunInputs { tokens: &tokens, positions: &positions, weights: &weights, epoch: std::time::Instant::now() };
    // No collective runs: a communicator of one rank stands in for the program's world.
    let mut comms = crate::comm::ThreadFabric::new(1, std::time::Duration::from_secs(1));
    let run = Run::new(program, &mut comms[0], &inputs, 1)?;
    let context = call_entry(RankContext { run, next_instr: 0, begun: false, check_only: true, error: None }, entry)?;
    Ok(context.next_instr)
}

/// `library`'s entry function, if it has one and was generated for `program`.
fn entry_for(program: &Program, library: &NativeKernels) -> Result<EntryFunction> {
    let refuse = |reason: String| Error::Program { rank: program.rank, instr: 0, reason };
    if !library.is_for(program) {
        return Err(refuse(format!(
            "{} was generated for another program; compile again with `pleat compile --emit so`",
            library.path().display()
        )));
    }
    library.entry().ok_or_else(|| {
        refuse(format!(
            "{} has no entry function; compile again with `pleat compile --emit so`",
            library.path().display()
        ))
    })
}

/// Calls `entry` on `context`; the context after a run that returned success having run every
/// instruction, or the error.
fn call_entry<'a>(mut context: RankContext<'a>, entry: EntryFunction) -> Result<RankContext<'a>> {
    let program = context.run.program();
    // SAFETY: `entry` is the entry function of a library generated for `program` (`entry_for`
    // checked the fingerprint); it receives the context the `pleat_rt_*` functions expect, which
    // outlives the call. Its kernels touch only the data `pleat_rt_operand` and `pleat_rt_result`
    // hand out, which check each buffer's size against the kernel's.
    let status = unsafe { entry(std::ptr::addr_of_mut!(context).cast()) };
    let rank = program.rank;
    if let Some(error) = context.error.take() {
        return Err(error);
    }
    if status != STATUS_OK {
        return Err(Error::Program {
            rank,
            instr: context.next_instr,
            reason: format!("the entry function returned status {status} without a runtime error"),
        });
    }
    if context.next_instr != program.instructions.len() {
        return Err(Error::Program {
            rank,
            instr: context.next_instr,
            reason: format!(
                "the entry function returned after {} of {} instructions; compile again with `pleat compile --emit so`",
                context.next_instr,
                program.instructions.len()
            ),
        });
    }
    Ok(context)
}

/// Every `pleat_rt_*` function with its symbol.
pub fn exported_functions() -> Vec<(&'static str, *const ())> {
    macro_rules! functions {
        ($($name:ident),* $(,)?) => { vec![$((stringify!($name), $name as *const ())),*] };
    }
    functions![
        pleat_rt_begin,
        pleat_rt_end,
        pleat_rt_operand,
        pleat_rt_result,
        pleat_rt_load_param,
        pleat_rt_load_tokens,
        pleat_rt_load_positions,
        pleat_rt_all_reduce,
        pleat_rt_reduce_scatter,
        pleat_rt_all_gather,
        pleat_rt_all_to_all,
        pleat_rt_broadcast,
        pleat_rt_send,
        pleat_rt_recv,
        pleat_rt_relay,
        pleat_rt_output,
        pleat_rt_free,
        pleat_rt_wait,
        pleat_rt_embedding,
        pleat_rt_rms_norm,
        pleat_rt_matmul,
        pleat_rt_rope,
        pleat_rt_attention,
        pleat_rt_merge_attention,
        pleat_rt_silu_mul,
        pleat_rt_add,
        pleat_rt_sum,
        pleat_rt_rms_norm_grad_input_add,
        pleat_rt_permute,
        pleat_rt_zeros,
        pleat_rt_slice,
        pleat_rt_cross_entropy,
        pleat_rt_cross_entropy_grad,
        pleat_rt_loss_row_stats,
        pleat_rt_cross_entropy_from_stats,
        pleat_rt_cross_entropy_grad_from_stats,
        pleat_rt_matmul_grad_input,
        pleat_rt_matmul_grad_weight,
        pleat_rt_rms_norm_grad_input,
        pleat_rt_rms_norm_grad_weight,
        pleat_rt_rope_grad,
        pleat_rt_attention_grad,
        pleat_rt_silu_mul_grad_gate,
        pleat_rt_embedding_grad,
        pleat_rt_sum_leading,
        pleat_rt_moe_mlp,
        pleat_rt_moe_mlp_grad,
        pleat_rt_expert_dispatch,
        pleat_rt_sigmoid_scale,
        pleat_rt_sigmoid_scale_grad_gate,
        pleat_rt_expert_counts,
        pleat_rt_router_prob_sum,
        pleat_rt_router_prob_sum_grad,
        pleat_rt_load_balancing_loss,
    ]
}

// === The calling discipline ===

impl RankContext<'_> {
    /// Checks that `instr` is the instruction due and begins it (once).
    fn begin(&mut self, instr: u64) -> Result<()> {
        let due = self.next_instr;
        if instr != due as u64 {
            return Err(self.run.program_error(format!(
                "the library called instruction {instr} where instruction {due} is due; compile again with \
                 `pleat compile --emit so`"
            )));
        }
        if !self.begun {
            self.run.begin(due);
            self.begun = true;
        }
        Ok(())
    }

    /// Ends the instruction due.
    fn end(&mut self, instr: u64) -> Result<()> {
        self.begin(instr)?;
        self.run.end();
        self.begun = false;
        self.next_instr += 1;
        Ok(())
    }

    /// Checks that buffer `buf` is the program's and holds `numel` elements, as the generated
    /// kernel that asks for it reads or writes.
    fn check_numel(&self, buf: u32, numel: u64) -> Result<()> {
        let declared = self.run.program().buffers.get(buf as usize).map(|declared| declared.numel());
        if declared != Some(numel) {
            return Err(self.run.program_error(format!(
                "the library's kernel takes {numel} elements of buffer b{buf}, the program declares {declared:?}; \
                 compile again with `pleat compile --emit so`"
            )));
        }
        Ok(())
    }

    /// Runs `instr`, rebuilt from a call's constants, if it is the program's instruction `index`.
    fn run_instruction(&mut self, index: u64, instr: Instr) -> Result<()> {
        self.begin(index)?;
        let program = self.run.program();
        // The ABI carries no stream: a prefetch on its own stream is the same instruction, and
        // the program's own copy, which names the stream, is the one run.
        let same = program.instructions.get(index as usize).is_some_and(|own| {
            *own == instr
                || own.transfer_stream() != TransferStream::Main && own.clone().on_stream(TransferStream::Main) == instr
        });
        if !same {
            return Err(self.run.program_error(format!(
                "the library's instruction {index} is {instr:?}, which differs from the program's; compile \
                 again with `pleat compile --emit so`"
            )));
        }
        if !self.check_only {
            self.run.step(index as usize, &program.instructions[index as usize], None)?;
        }
        self.end(index)
    }
}

/// Runs `body` on the context behind `context`, turning an error or a panic into `failed` with the
/// reason kept in the context.
///
/// # Safety
/// `context` is null or the pointer [`execute_entry`] passed to the entry function.
unsafe fn guarded<T>(context: *mut c_void, failed: T, body: impl FnOnce(&mut RankContext) -> Result<T>) -> T {
    // SAFETY: the caller passes the context `execute_entry` made, alive for the entry call.
    let Some(context) = (unsafe { context.cast::<RankContext>().as_mut() }) else {
        return failed;
    };
    if context.error.is_some() {
        // A call after a failure: the generated code checks every status, so this is another caller.
        return failed;
    }
    match catch_unwind(AssertUnwindSafe(|| body(context))) {
        Ok(Ok(value)) => value,
        Ok(Err(error)) => {
            context.error = Some(error);
            failed
        }
        Err(payload) => {
            let message = payload
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| payload.downcast_ref::<&str>().map(|text| text.to_string()))
                .unwrap_or_else(|| "unknown panic".to_string());
            context.error = Some(Error::Panicked { rank: context.run.program().rank, message });
            failed
        }
    }
}

/// Runs the instruction `decode` rebuilds, as [`RankContext::run_instruction`]; `decode` gives
/// `None` for constants that make no instruction.
///
/// # Safety
/// As [`guarded`]; `decode` reads only the pointers its call passed, with their counts.
unsafe fn instruction(context: *mut c_void, index: u64, decode: impl FnOnce() -> Option<Instr>) -> i32 {
    // SAFETY: forwarded from the caller.
    unsafe {
        guarded(context, STATUS_ERROR, |context| {
            let instr = decode().ok_or_else(|| {
                context.run.program_error(format!(
                    "the library's call for instruction {index} passes constants that make no instruction; \
                     compile again with `pleat compile --emit so`"
                ))
            })?;
            context.run_instruction(index, instr)?;
            Ok(STATUS_OK)
        })
    }
}

/// The `count` elements at `data` (empty when `count` is 0).
///
/// # Safety
/// `data` points to `count` initialized elements that outlive the use, or `count` is 0.
unsafe fn slice<'s, T>(data: *const T, count: u64) -> &'s [T] {
    if count == 0 || data.is_null() {
        &[]
    } else {
        // SAFETY: guaranteed by the caller (generated code passes its constant arrays).
        unsafe { std::slice::from_raw_parts(data, count as usize) }
    }
}

/// A region from its flattened `(start, len)` pairs.
///
/// # Safety
/// As [`slice`].
unsafe fn region(data: *const u64, count: u64) -> Vec<(u64, u64)> {
    // SAFETY: forwarded from the caller.
    let values = unsafe { slice(data, count) };
    let mut pairs: Vec<(u64, u64)> = values.chunks_exact(2).map(|pair| (pair[0], pair[1])).collect();
    if values.len() % 2 == 1 {
        // An odd count is no region; a pair that cannot be the program's makes the check fail.
        pairs.push((u64::MAX, u64::MAX));
    }
    pairs
}

/// UTF-8 text (lossy: a name that is not UTF-8 cannot equal the program's).
///
/// # Safety
/// As [`slice`].
unsafe fn text(data: *const u8, length: u64) -> String {
    // SAFETY: forwarded from the caller.
    String::from_utf8_lossy(unsafe { slice(data, length) }).into_owned()
}

/// Buffer ids.
///
/// # Safety
/// As [`slice`].
unsafe fn buffers(data: *const u32, count: u64) -> Vec<BufferId> {
    // SAFETY: forwarded from the caller.
    unsafe { slice(data, count) }.iter().map(|&id| BufferId::new(id as usize)).collect()
}

/// A group from its axis name and ranks.
///
/// # Safety
/// As [`slice`].
unsafe fn group(axis: *const u8, axis_length: u64, ranks: *const u32, rank_count: u64) -> Group {
    // SAFETY: forwarded from the caller.
    unsafe { Group { axis: text(axis, axis_length), ranks: slice(ranks, rank_count).to_vec() } }
}

fn buffer(id: u32) -> BufferId {
    BufferId::new(id as usize)
}

fn kernel(kernel: Kernel, inputs: &[u32], out: u32) -> Instr {
    Instr::Kernel { kernel, inputs: inputs.iter().map(|&id| buffer(id)).collect(), out: buffer(out) }
}

// === Brackets and buffers for generated code ===

/// Begins instruction `instr`, which generated code runs (or which a fused kernel already ran).
///
/// # Safety
/// `ctx` is the context the entry function received.
#[no_mangle]
pub unsafe extern "C" fn pleat_rt_begin(ctx: *mut c_void, instr: u64) -> i32 {
    // SAFETY: forwarded from the caller.
    unsafe {
        guarded(ctx, STATUS_ERROR, |context| {
            context.begin(instr)?;
            Ok(STATUS_OK)
        })
    }
}

/// Ends instruction `instr`, begun with [`pleat_rt_begin`].
///
/// # Safety
/// `ctx` is the context the entry function received.
#[no_mangle]
pub unsafe extern "C" fn pleat_rt_end(ctx: *mut c_void, instr: u64) -> i32 {
    // SAFETY: forwarded from the caller.
    unsafe {
        guarded(ctx, STATUS_ERROR, |context| {
            context.end(instr)?;
            Ok(STATUS_OK)
        })
    }
}

/// The data of written buffer `buf` (f32, or u32 for ids and positions), which the calling kernel
/// reads `numel` elements of; null on error (also when the buffer holds another count).
///
/// # Safety
/// `ctx` is the context the entry function received.
#[no_mangle]
pub unsafe extern "C" fn pleat_rt_operand(ctx: *mut c_void, instr: u64, buf: u32, numel: u64) -> *const c_void {
    // SAFETY: forwarded from the caller.
    unsafe {
        guarded(ctx, std::ptr::null(), |context| {
            context.begin(instr)?;
            context.check_numel(buf, numel)?;
            if context.check_only {
                context.run.zero_if_unwritten(buffer(buf))?;
            }
            context.run.operand_pointer(buffer(buf))
        })
    }
}

/// Allocates buffer `buf` (zeroed f32 of its declared size), which the calling kernel writes
/// `numel` elements of, and returns its data; null on error (also when the buffer holds another
/// count).
///
/// # Safety
/// `ctx` is the context the entry function received.
#[no_mangle]
pub unsafe extern "C" fn pleat_rt_result(ctx: *mut c_void, instr: u64, buf: u32, numel: u64) -> *mut f32 {
    // SAFETY: forwarded from the caller.
    unsafe {
        guarded(ctx, std::ptr::null_mut(), |context| {
            context.begin(instr)?;
            context.check_numel(buf, numel)?;
            context.run.result_pointer(buffer(buf))
        })
    }
}

#[path = "capi_instructions.rs"]
mod instructions;
pub use instructions::*;

#[cfg(test)]
mod tests {
    use super::*;
    use pleat_backend::native::abi::{BEGIN_SYMBOL, END_SYMBOL, INSTRUCTION_SYMBOLS, OPERAND_SYMBOL, RESULT_SYMBOL};

    #[test]
    fn the_runtime_defines_every_symbol_of_the_abi() {
        let mut defined: Vec<&str> = exported_functions().into_iter().map(|(name, _)| name).collect();
        let mut listed: Vec<&str> = INSTRUCTION_SYMBOLS
            .iter()
            .copied()
            .chain([BEGIN_SYMBOL, END_SYMBOL, OPERAND_SYMBOL, RESULT_SYMBOL])
            .collect();
        defined.sort_unstable();
        listed.sort_unstable();
        assert_eq!(defined, listed);
    }

    #[test]
    fn a_null_context_is_an_error_not_a_crash() {
        // SAFETY: a null context is allowed: every function refuses it.
        unsafe {
            assert_eq!(pleat_rt_begin(std::ptr::null_mut(), 0), STATUS_ERROR);
            assert!(pleat_rt_operand(std::ptr::null_mut(), 0, 0, 1).is_null());
            assert_eq!(pleat_rt_free(std::ptr::null_mut(), 0, 0), STATUS_ERROR);
        }
    }
}
