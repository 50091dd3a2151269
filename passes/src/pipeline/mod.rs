//! Pipeline parallelism's planning layer: schedules as data, their simulation, stage balancing.
//!
//! A pipeline splits the layers into `stages` ranks (or `stages · chunks` virtual stages when each
//! rank holds several model chunks). A [`Schedule`] is the per-rank order of
//! (micro-batch, chunk, phase) steps; the lowering will turn each into compute, send and receive
//! instructions. [`simulate()`] runs the steps under their data dependencies with given step costs
//! and reports the makespan, each rank's busy and idle time, the bubble and the peak number of
//! micro-batches in flight a stage; a schedule whose order cannot complete is an error that names
//! the stage and the step, never a hang. [`balance()`] splits layer costs into contiguous stages that
//! minimize the largest stage, and [`cost_balanced_layers`] feeds it the cost model's layer, embedding
//! and head costs (the default split); [`parse_pp_layers`] reads the `--pp-layers 9,8,8,7` override.
//! [`render_text`] draws a timeline as one text row a stage.
//!
//! - [`schedule`]: GPipe, 1F1B (PipeDream-flush), interleaved 1F1B (Megatron), ZB-H1 (Qi et al.).
//! - [`simulate`](mod@simulate): the dependency-respecting simulation and its [`Timeline`].
//! - [`balance`](mod@balance): layer-to-stage assignment.
//! - [`cost_split`]: the assignment the cost model's costs give.
//! - [`picture`]: the text picture.
//! - [`measured`]: a timeline from a run's measured step times, drawn like a simulation.
//!
//! Guarantees: everything is pure and deterministic, and bad input is a [`ScheduleError`], never a
//! panic. Not here: executing a pipelined program (`pleat_backend::pipeline` lowers these schedules).

pub mod balance;
pub mod cost_split;
pub mod error;
pub mod measured;
pub mod picture;
pub mod schedule;
pub mod simulate;

pub use balance::{balance, parse_pp_layers};
pub use cost_split::{cost_balanced_layers, part_costs, PartCosts};
pub use error::{Result, ScheduleError};
pub use measured::{drawing_costs, measured_timeline};
pub use picture::render_text;
pub use schedule::{Phase, Schedule, ScheduleKind, Step};
pub use simulate::{check_complete, simulate, StepCosts, TimedStep, Timeline};
