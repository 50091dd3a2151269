//! Opening a CUDA device, and what the runtime needs to know of it.

use std::sync::Arc;

use cudarc::driver::{sys, CudaContext};

use crate::error::{Error, Result};

/// An opened GPU: its context (the device's primary context, shared by the rank threads) and its
/// name, compute capability and memory.
pub struct CudaDevice {
    context: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    capability: (i32, i32),
    memory_bytes: usize,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(formatter, "{}", self.describe())
    }
}

impl CudaDevice {
    /// Opens device `ordinal`. Fails with [`Error::NoCudaDevice`], saying why, when the CUDA driver
    /// or cuBLAS cannot be loaded, when the driver finds no device, or when the device is older than
    /// sm_80 (the oldest architecture pleat emits PTX for); never panics.
    pub fn open(ordinal: usize) -> Result<CudaDevice> {
        let no_device = |reason: String| Error::NoCudaDevice { reason };
        // cudarc loads libcuda at its first call and panics when it is absent: look first.
        // SAFETY: only tries to load the library and drops it.
        if !unsafe { sys::is_culib_present() } {
            return Err(no_device(
                "the CUDA driver library (libcuda.so.1) cannot be loaded: this machine has no NVIDIA driver".into(),
            ));
        }
        let count = CudaContext::device_count()
            .map_err(|error| no_device(format!("the CUDA driver found no usable device ({error})")))?;
        let count = usize::try_from(count).unwrap_or(0);
        if ordinal >= count {
            return Err(no_device(format!("device {ordinal} was asked for and the driver sees {count}")));
        }
        // SAFETY: as above.
        if !unsafe { cudarc::cublas::sys::is_culib_present() } {
            return Err(no_device(
                "cuBLAS (libcublas.so.12) cannot be loaded; install the CUDA 12 runtime libraries".into(),
            ));
        }
        let context = CudaContext::new(ordinal)
            .map_err(|error| no_device(format!("device {ordinal} could not be opened ({error})")))?;
        let failed = |what: &str, error: cudarc::driver::DriverError| no_device(format!("{what}: {error}"));
        let name = context.name().map_err(|error| failed("reading the device's name", error))?;
        let capability =
            context.compute_capability().map_err(|error| failed("reading the compute capability", error))?;
        let memory_bytes = context.total_mem().map_err(|error| failed("reading the device's memory", error))?;
        if capability.0 < 8 {
            return Err(no_device(format!(
                "{name} is sm_{}{}; pleat's PTX needs sm_80 or later (A100, H100, H200)",
                capability.0, capability.1
            )));
        }
        Ok(CudaDevice { context, ordinal, name, capability, memory_bytes })
    }

    /// The architecture to emit PTX for (`pleat_backend::llvm::PTX_ARCHES`): sm_90 on Hopper and
    /// later (the driver compiles it for newer devices), sm_80 on Ampere and Ada.
    pub fn ptx_arch(&self) -> &'static str {
        if self.capability.0 >= 9 {
            "sm_90"
        } else {
            "sm_80"
        }
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its memory in bytes.
    pub fn memory_bytes(&self) -> usize {
        self.memory_bytes
    }

    /// `device 0: NVIDIA H200 (sm_90, 140.4 GiB)`.
    pub fn describe(&self) -> String {
        format!(
            "device {}: {} (sm_{}{}, {:.1} GiB)",
            self.ordinal,
            self.name,
            self.capability.0,
            self.capability.1,
            self.memory_bytes as f64 / (1u64 << 30) as f64
        )
    }

    /// Makes the device's context current on the calling thread.
    pub(super) fn bind(&self) -> std::result::Result<(), cudarc::driver::DriverError> {
        self.context.bind_to_thread()
    }
}
