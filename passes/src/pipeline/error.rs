//! The errors of the pipeline planning layer: building, simulating and balancing schedules.

use crate::pipeline::schedule::Step;

/// `Result` with [`ScheduleError`].
pub type Result<T> = std::result::Result<T, ScheduleError>;

/// Everything building, simulating or balancing a pipeline schedule can fail with.
#[derive(Debug, Clone, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum ScheduleError {
    // === Building ===
    /// A count that must be at least one.
    #[error("{what} = 0: give at least 1")]
    #[diagnostic(code(E0220), help("give a count of at least 1"))]
    Zero {
        /// The count (`stages`, `micro-batches`, `chunks`).
        what: &'static str,
    },
    /// Interleaving with one chunk a rank is plain 1F1B.
    #[error("interleaved 1F1B needs at least 2 chunks a rank (got {chunks}); use --schedule 1f1b for one chunk")]
    #[diagnostic(code(E0221), help("use --chunks 2 or more, or --schedule 1f1b"))]
    TooFewChunks {
        /// The chunks given.
        chunks: u32,
    },
    /// Megatron's interleaved schedule sends micro-batches through the chunks in groups of `stages`.
    #[error(
        "interleaved 1F1B needs micro-batches divisible by the stages, as Megatron requires: {micro_batches} is not a multiple of pp={stages}; use --micro-batches in {{{}}}",
        (1..=4).map(|k| (k * stages).to_string()).collect::<Vec<_>>().join(", ") + ", ..."
    )]
    #[diagnostic(code(E0222), help("make --micro-batches a multiple of the pp degree"))]
    MicroBatchesNotDivisible {
        /// The micro-batches given.
        micro_batches: u32,
        /// The pipeline stages.
        stages: u32,
    },

    /// A schedule too large to build: its steps (and `pleat schedule`'s picture) would not fit.
    #[error(
        "pp={stages} with {micro_batches} micro-batches and {chunks} chunk(s) a rank spans {cells} cells (stages × \
         (micro-batches × chunks + stages)), more than the {max} pleat builds a schedule of; use fewer \
         micro-batches or stages",
        max = crate::pipeline::schedule::MAX_SCHEDULE_CELLS
    )]
    #[diagnostic(code(E0234), help("use fewer micro-batches or stages"))]
    TooLarge {
        /// The pipeline stages.
        stages: u32,
        /// The micro-batches given.
        micro_batches: u32,
        /// Chunks a rank.
        chunks: u32,
        /// `stages · (micro_batches · chunks + stages)`.
        cells: u64,
    },

    // === Simulation ===
    /// A step whose micro-batch or chunk lies outside the schedule's ranges.
    #[error("stage {stage}, step {index} ({step}) is out of range: the schedule has {micro_batches} micro-batches and {chunks} chunks a stage")]
    #[diagnostic(code(E0223), help("keep steps within the schedule's micro-batches and chunks"))]
    StepOutOfRange {
        /// The stage (rank).
        stage: u32,
        /// The step's position in the stage's list.
        index: usize,
        /// The step.
        step: Step,
        /// Micro-batches of the schedule.
        micro_batches: u32,
        /// Chunks a stage.
        chunks: u32,
    },
    /// A step that appears twice on a stage.
    #[error("stage {stage} runs {step} twice (steps {first} and {second}); each step runs once")]
    #[diagnostic(code(E0224), help("run each step once a stage"))]
    DuplicateStep {
        /// The stage.
        stage: u32,
        /// The step.
        step: Step,
        /// Its first position.
        first: usize,
        /// Its second position.
        second: usize,
    },
    /// A stage that never runs a step the pipeline needs.
    #[error("stage {stage} never runs {step}; every micro-batch needs a forward and a backward (or backward-input and backward-weight) on every chunk")]
    #[diagnostic(code(E0225), help("give every stage a forward and a backward for every micro-batch and chunk"))]
    MissingStep {
        /// The stage.
        stage: u32,
        /// The missing step.
        step: Step,
    },
    /// A stage that mixes a whole backward with the split one for the same micro-batch and chunk.
    #[error("stage {stage} runs both a whole backward and a split one for micro-batch {micro_batch}, chunk {chunk}; use either backward or backward-input plus backward-weight")]
    #[diagnostic(code(E0226), help("use a whole backward or backward-input plus backward-weight, not both"))]
    MixedBackward {
        /// The stage.
        stage: u32,
        /// The micro-batch.
        micro_batch: u32,
        /// The chunk.
        chunk: u32,
    },
    /// The stages' orders wait on each other in a cycle: the schedule would hang.
    #[error("the schedule cannot complete: stage {stage} waits at step {index} ({step}) for {waits_for} on stage {waits_on_stage}, which that stage's order never reaches first{}", if .other_blocked.is_empty() { String::new() } else { format!("; stages {} are blocked too", .other_blocked.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")) })]
    #[diagnostic(code(E0227), help("reorder the stages' steps so each waits only for steps run earlier"))]
    Deadlock {
        /// The first blocked stage.
        stage: u32,
        /// The position of its blocked step.
        index: usize,
        /// The blocked step.
        step: Step,
        /// The step it waits for.
        waits_for: Step,
        /// The stage that must run `waits_for`.
        waits_on_stage: u32,
        /// The other stages that cannot finish.
        other_blocked: Vec<u32>,
    },
    /// A step cost that is negative or not finite.
    #[error("step cost {what} = {value} must be finite and not negative")]
    #[diagnostic(code(E0228), help("give finite, non-negative step costs"))]
    BadCost {
        /// The cost's name.
        what: &'static str,
        /// Its value.
        value: f64,
    },

    // === Balancing ===
    /// More stages than layers: a stage would hold no layer.
    #[error("{layers} layers cannot fill {stages} stages with at least one layer each; use at most {layers} stages")]
    #[diagnostic(code(E0229), help("use at most as many stages as layers"))]
    TooFewLayers {
        /// The layers.
        layers: usize,
        /// The stages asked for.
        stages: u32,
    },
    /// A layer cost that is negative or not finite.
    #[error("layer {layer}'s cost {value} must be finite and not negative")]
    #[diagnostic(code(E0230), help("give finite, non-negative layer costs"))]
    BadLayerCost {
        /// The layer.
        layer: usize,
        /// Its cost.
        value: f64,
    },
    /// A `--pp-layers` entry that is not a positive integer.
    #[error(
        "--pp-layers {text}: entry {position} ({entry:?}) is not a positive layer count; write counts like 9,8,8,7"
    )]
    #[diagnostic(code(E0231), help("write --pp-layers as positive counts separated by commas, e.g. 9,8,8,7"))]
    PpLayersEntry {
        /// The whole argument.
        text: String,
        /// The entry's position (from 1).
        position: usize,
        /// The entry.
        entry: String,
    },
    /// A `--pp-layers` list with the wrong number of entries.
    #[error("--pp-layers {text}: {got} entries for {stages} stages; give one layer count a stage")]
    #[diagnostic(code(E0232), help("give one --pp-layers count a pipeline stage"))]
    PpLayersCount {
        /// The whole argument.
        text: String,
        /// The entries given.
        got: usize,
        /// The stages.
        stages: u32,
    },
    /// A `--pp-layers` list that does not sum to the model's layers.
    #[error("--pp-layers {text}: the counts sum to {got}, the model has {total_layers} layers; make them sum to {total_layers}")]
    #[diagnostic(code(E0233), help("make the --pp-layers counts sum to the model's layers"))]
    PpLayersSum {
        /// The whole argument.
        text: String,
        /// The sum of the counts.
        got: u64,
        /// The model's layers.
        total_layers: u32,
    },
}
