//! Training on the device: each rank's forward-and-backward program runs on the GPU a step (as
//! [`super::run_on_device`] runs a forward: GEMMs and their gradients on cuBLAS, the kernels with
//! generated code launched, every other instruction on the host), and the optimizer updates the
//! rank's resident parameters on the host between steps, as [`crate::train::train_on_threads`]
//! does; each step uploads them again.

use std::collections::BTreeMap;

use pleat_backend::native::DeviceCode;
use pleat_backend::optimizer::OptimizerLayout;
use pleat_backend::Program;

use super::device::CudaDevice;
use super::run::execute_on_device;
use crate::comm::ThreadFabric;
use crate::error::Result;
use crate::train::{check_layouts, train_rank, RankTraining, TrainOptions};

/// One rank's training on the device, and where its first step's instructions ran.
#[derive(Clone, Debug)]
pub struct DeviceRankTraining {
    /// What the training produced and measured (its peak: device memory plus the optimizer's
    /// state on the host).
    pub training: RankTraining,
    /// The first step's instructions run on the GPU.
    pub on_device: usize,
    /// The first step's instructions run on the host, by kind.
    pub on_host: BTreeMap<String, usize>,
}

/// Trains `programs` (one a rank, each with its optimizer layout) as threads sharing `device`, rank
/// `i` launching `code[i]`'s kernels where it has them; `options.native` is not read. The ranks'
/// collectives go over the threads communicator, through the host.
pub fn train_on_device(
    programs: &[Program],
    layouts: &[OptimizerLayout],
    options: &TrainOptions,
    device: &CudaDevice,
    code: &[Option<DeviceCode>],
) -> Result<Vec<DeviceRankTraining>> {
    check_layouts(programs, layouts)?;
    crate::launch::check_thread_ranks(programs.len() as u64)?;
    let comms = ThreadFabric::with_link(programs.len() as u32, options.timeout, options.link);
    crate::launch::on_threads(comms, |rank, comm| {
        let code = code.get(rank as usize).and_then(Option::as_ref);
        let mut first_step: Option<(usize, BTreeMap<String, usize>)> = None;
        let training = train_rank(
            &programs[rank as usize],
            &layouts[rank as usize],
            comm,
            options,
            &mut |program, comm, inputs| {
                let ran = execute_on_device(program, comm, inputs, 1, device, code)?;
                first_step.get_or_insert_with(|| (ran.on_device, ran.on_host.clone()));
                Ok(ran.outcome)
            },
        )?;
        let (on_device, on_host) = first_step.unwrap_or_default();
        Ok(DeviceRankTraining { training, on_device, on_host })
    })
}
