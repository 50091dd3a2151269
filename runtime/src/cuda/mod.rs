//! The CUDA runtime (feature `cuda`): each rank's `Program` on a GPU.
//!
//! Built on `cudarc` with dynamic loading, so pleat builds and runs its CPU path on a machine with
//! no CUDA at all; opening a device there is an error that says why ([`CudaDevice::open`]).
//!
//! A rank's buffers live in device memory, in one allocation laid out by the memory planner
//! (`pleat_backend::memory::plan`, each element at its declared size), so the measured peak is the
//! planned one. Its instructions run on one CUDA stream of the rank:
//! - GEMMs (`MatMul` and its two gradients) on cuBLAS's `cublasGemmEx`: f32, or bf16 operands
//!   into a bf16 or f32 result, f32 accumulation either way;
//! - the kernels that have generated code (residual adds, SiLU-mul, RMSNorm, RoPE, a residual add
//!   fused with the RMSNorm reading it, the embedding lookup, attention's forward and the merge of
//!   ring attention's states) as the PTX
//!   `pleat_backend::llvm::device_code` emits, one thread a row, element or query row, each
//!   buffer read at its declared type (bf16 widened when read, rounded to nearest even when
//!   written, as the CPU runtime stores it); an embedding's token ids are checked on the host
//!   before its launch, as the CPU kernel checks them;
//! - every other instruction (weight and token loads, collectives, the remaining kernels) on the
//!   host: its operands are copied out of device memory, the CPU executor's own step runs it (so
//!   its values are the CPU runtime's, and collectives go over the rank's communicator), and its
//!   results are copied back. [`DeviceRankOutcome`] counts both kinds, so a report says how much
//!   of a program ran on the GPU.
//!
//! Ranks are threads sharing one device (NCCL refuses two ranks on one GPU); their collectives run
//! over the threads communicator through the host. Training ([`train_on_device`]) runs each step's
//! forward-and-backward program so, and the optimizer on the host between steps.

mod device;
mod memory;
mod run;
mod train;

pub use device::CudaDevice;
pub use run::{run_on_device, DeviceRankOutcome};
pub use train::{train_on_device, DeviceRankTraining};
