//! A rank's device memory: the planned arena, plus an allocation of its own for each buffer the
//! plan gives no single slot (one written in more than one lifetime).

use cudarc::driver::{result as driver, sys, DriverError};
use pleat_backend::{BufferId, Program};

use crate::arena::planned_slots;

/// Every buffer's device address, fixed for the whole run.
pub(super) struct DeviceMemory {
    /// The arena, `arena_bytes` long.
    arena: sys::CUdeviceptr,
    arena_bytes: usize,
    /// Each buffer's address (0 for a buffer the program never writes).
    addresses: Vec<sys::CUdeviceptr>,
    /// The allocations of the buffers without a slot, freed with the memory.
    own: Vec<sys::CUdeviceptr>,
}

impl DeviceMemory {
    /// Allocates `program`'s arena and the buffers without a slot; the device's context must be
    /// current. `None` from the planner (an arena past the address space) is an error here.
    pub(super) fn new(program: &Program) -> Result<DeviceMemory, String> {
        let (arena_bytes, slots) =
            planned_slots(program).ok_or_else(|| "the planned arena does not fit the address space".to_string())?;
        let mut memory =
            DeviceMemory { arena: 0, arena_bytes, addresses: vec![0; program.buffers.len()], own: Vec::new() };
        let allocation_error = |bytes: usize, error: DriverError| format!("allocating {bytes} bytes: {error}");
        // SAFETY: allocates; the context is current (the caller's contract).
        memory.arena =
            unsafe { driver::malloc_sync(arena_bytes.max(1)) }.map_err(|e| allocation_error(arena_bytes, e))?;
        let written: Vec<bool> = {
            let mut written = vec![false; program.buffers.len()];
            for instr in &program.instructions {
                for out in instr.outs() {
                    if let Some(slot) = written.get_mut(out.as_u32() as usize) {
                        *slot = true;
                    }
                }
            }
            written
        };
        for (index, buffer) in program.buffers.iter().enumerate() {
            match slots.get(index).copied().flatten() {
                Some(offset) => memory.addresses[index] = memory.arena + offset as u64,
                None if written[index] => {
                    let bytes = usize::try_from(buffer.bytes()).unwrap_or(usize::MAX).max(1);
                    // SAFETY: as above.
                    let address = unsafe { driver::malloc_sync(bytes) }.map_err(|e| allocation_error(bytes, e))?;
                    memory.own.push(address);
                    memory.addresses[index] = address;
                }
                None => {}
            }
        }
        Ok(memory)
    }

    /// Buffer `id`'s device address (0 when the program never writes it).
    pub(super) fn address(&self, id: BufferId) -> sys::CUdeviceptr {
        self.addresses.get(id.as_u32() as usize).copied().unwrap_or(0)
    }

    /// The arena's size in bytes.
    pub(super) fn arena_bytes(&self) -> usize {
        self.arena_bytes
    }
}

impl Drop for DeviceMemory {
    fn drop(&mut self) {
        for &address in self.own.iter().chain(std::iter::once(&self.arena)) {
            if address != 0 {
                // SAFETY: each address was allocated by `malloc_sync` and is freed once; the rank's
                // stream has been synchronized before the run's memory is dropped. A failure to free
                // at the end of a run leaves nothing to recover.
                let _ = unsafe { driver::free_sync(address) };
            }
        }
    }
}
