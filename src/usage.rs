//! The errors the command line itself raises: flags that do not fit together, input files of the
//! binary's own formats (token files, compiled directories, search plans, training checkpoints),
//! and failed checks.
//!
//! Each variant has a stable code (`E05xx` for compiled directories, plan files and training
//! checkpoints, `E07xx` for usage and checks; docs/errors.md lists them all) and a help line, and
//! names the file or flag at fault so that `report` can print its location. The variants that say
//! "this is a pleat bug" guard invariants the compiler should keep, not user input.

use std::path::PathBuf;

/// An error of the `pleat` command line, with a stable code.
#[derive(Debug, thiserror::Error, miette::Diagnostic)]
pub enum UsageError {
    // === Mesh and strategy ===
    /// `--strategy` names an axis the mesh lacks.
    #[error("--strategy {strategy} needs the {axis} axis in --mesh, e.g. --mesh {axis}=4")]
    #[diagnostic(code(E0213), help("add the strategy's axis to --mesh, or use --strategy auto"))]
    StrategyNeedsAxis {
        /// The strategy's name.
        strategy: &'static str,
        /// The axis it splits.
        axis: &'static str,
    },

    // === Compiled directories and plan files ===
    /// A compiled directory's plan.json of another format version.
    #[error("{}: plan format {found} is not {expected}; recompile with this pleat", .path.display())]
    #[diagnostic(code(E0520), help("run `pleat compile` again with this pleat"))]
    PlanFormatVersion {
        /// The plan.json.
        path: PathBuf,
        /// The version the file says.
        found: u32,
        /// The version this build reads.
        expected: u32,
    },
    /// A compiled directory whose files do not hash to its plan's fingerprint.
    #[error(
        "{}: the plan hash is {recorded:?} but the files hash to {actual}; the directory was changed after \
         `pleat compile` wrote it: compile it again",
        .path.display()
    )]
    #[diagnostic(code(E0521), help("run `pleat compile` again; do not edit a compiled directory's files"))]
    PlanHashMismatch {
        /// The plan.json.
        path: PathBuf,
        /// The hash plan.json records.
        recorded: String,
        /// The hash of the files as read.
        actual: String,
    },
    /// A native artifact of a compiled directory that is not the one `pleat compile` wrote.
    #[error(
        "{}: {}; pleat will not load it",
        .path.display(),
        .recorded.as_ref().map_or(
            "`pleat compile` did not write it (plan.json records no such artifact)".to_string(),
            |hash| format!("plan.json records hash {hash}, but the file hashes to {actual}: it was changed after `pleat compile` wrote it")
        )
    )]
    #[diagnostic(code(E0553), help("run `pleat compile ... --emit` again into a fresh directory"))]
    NativeFileChanged {
        /// The file.
        path: PathBuf,
        /// The hash plan.json records for it, if any.
        recorded: Option<String>,
        /// The file's hash.
        actual: String,
    },
    /// A file a compiled directory must hold is absent or unreadable.
    #[error("cannot read {}: {reason}; the compiled directory is incomplete, compile it again", .path.display())]
    #[diagnostic(code(E0522), help("run `pleat compile` again into a fresh directory"))]
    CompiledFileUnreadable {
        /// The file.
        path: PathBuf,
        /// The operating system's reason.
        reason: String,
    },
    /// A plan.json or search plan that is not one.
    #[error("{} is not a pleat {what}: {reason}", .path.display())]
    #[diagnostic(
        code(E0523),
        help("pass a file written by `pleat compile` (plan.json) or `pleat search --emit-plan`")
    )]
    NotAPlan {
        /// The file.
        path: PathBuf,
        /// `plan`, `search plan` or `optimizer layout`.
        what: &'static str,
        /// The JSON parser's message.
        reason: String,
    },
    /// A search plan of another format version.
    #[error("{}: plan format {found} is not {expected}; search again with this pleat", .path.display())]
    #[diagnostic(code(E0524), help("run `pleat search` again with this pleat"))]
    SearchPlanVersion {
        /// The search plan.
        path: PathBuf,
        /// The version the file says.
        found: u32,
        /// The version this build reads.
        expected: u32,
    },
    /// A search plan naming a strategy this build does not have.
    #[error("{}: unknown strategy {strategy:?}; search again with this pleat", .path.display())]
    #[diagnostic(code(E0525), help("run `pleat search` again with this pleat"))]
    UnknownPlanStrategy {
        /// The search plan.
        path: PathBuf,
        /// The strategy it names.
        strategy: String,
    },
    /// `--emit` in a build without LLVM.
    #[error(
        "--emit needs native code generation, but pleat was built without the `llvm` feature; rebuild with \
         the default features (`cargo build`, which needs llvm-19-dev) to use --emit"
    )]
    #[diagnostic(code(E0526), help("drop --emit, or rebuild pleat with the default features"))]
    NativeUnavailable,
    /// `--device cuda` in a build without the `cuda` feature.
    #[error(
        "--device cuda runs the ranks on an NVIDIA GPU, but pleat was built without the `cuda` feature; rebuild \
         with `cargo build --release --features cuda` (it builds without CUDA and looks for the driver when run)"
    )]
    #[diagnostic(code(E0545), help("drop --device cuda, or rebuild pleat with --features cuda"))]
    CudaUnavailable,
    /// `--device cuda` beside a flag of the CPU runtime only.
    #[error("{flag} is for the CPU runtime; --device cuda runs its own kernels, collectives through the host")]
    #[diagnostic(code(E0546), help("drop {flag}, or run on the CPU (--device cpu)"))]
    CpuOnlyFlag {
        /// The flag.
        flag: &'static str,
    },
    /// `--warmup` without `--device cuda`.
    #[error("--warmup is for a run on the GPU (--device cuda): it runs the forward pass first, untimed, so that the run reported finds the GPU's kernels loaded")]
    #[diagnostic(code(E0547), help("add --device cuda, or drop --warmup"))]
    WarmupWithoutCuda,
    /// `--native` for a compiled directory, whose files decide how each rank runs.
    #[error("--native generates code for a model; {dir} is compiled, and runs the code it holds (compile it with --emit so or --emit exe)")]
    #[diagnostic(code(E0544), help("drop --native, or compile the directory with `--emit so`"))]
    NativeOfCompiled {
        /// The directory.
        dir: String,
    },
    /// `--emit exe` without the static runtime to link the ranks with.
    #[error(
        "--emit exe links each rank with the static runtime libpleat_rt.a, which is not at {searched}; build it with \
         `cargo build --release -p pleat-rt` (it needs Open MPI: apt-get install libopenmpi-dev libclang-dev) or \
         name it with PLEAT_RUNTIME_LIB=PATH"
    )]
    #[diagnostic(
        code(E0537),
        help("build the static runtime with `cargo build --release -p pleat-rt`, or set PLEAT_RUNTIME_LIB")
    )]
    RuntimeLibraryNotFound {
        /// The places looked in.
        searched: String,
    },
    /// A compiled directory with executables for some ranks only.
    #[error("{dir} has rank executables, but not rank{rank}; compile it again with `pleat compile ... --emit exe`")]
    #[diagnostic(code(E0538), help("compile the directory again with `--emit exe`"))]
    ExecutablesIncomplete {
        /// The directory.
        dir: String,
        /// A rank without an executable.
        rank: u32,
    },
    /// Running a directory's rank executables failed or was refused.
    #[error("cannot run the rank executables of {dir}: {reason}")]
    #[diagnostic(
        code(E0539),
        help("the rank executables run under mpirun (install openmpi-bin); read the ranks' report above")
    )]
    ExecutablesFailed {
        /// The directory.
        dir: String,
        /// What went wrong and how to fix it.
        reason: String,
    },
    /// `pleat launch` of something other than a compiled directory whose every rank has a library
    /// with an entry function.
    #[error("cannot launch {dir}: {reason}")]
    #[diagnostic(
        code(E0528),
        help("compile with `pleat compile MODEL --mesh ... --emit so --out DIR`, or use `pleat run`")
    )]
    NotLaunchable {
        /// The directory (MODEL) given.
        dir: String,
        /// What it lacks.
        reason: String,
    },
    /// Programs whose simulation cannot finish.
    #[error("the programs wait on each other forever ({}); recompile them with this pleat", .stuck.join(", "))]
    #[diagnostic(code(E0527), help("run `pleat compile` again with this pleat"))]
    ProgramsStuck {
        /// Each blocked rank and its instruction.
        stuck: Vec<String>,
    },
    /// The overlap scheduler's programs computed other logits than the blocking ones.
    #[error(
        "the scheduled programs' logits differ from the blocking programs'; reordering must never change a number"
    )]
    #[diagnostic(code(E0529), help("report the model and mesh; compile with --no-overlap meanwhile"))]
    OverlapChangedNumbers,

    // === Training checkpoints ===
    /// A checkpoint index of another format version.
    #[error(
        "{}: checkpoint format {found} is not {expected}; this pleat cannot read it, save the checkpoint again with \
         this pleat",
        .path.display()
    )]
    #[diagnostic(
        code(E0540),
        help("train again with --save using this pleat, or resume with the pleat that saved it")
    )]
    CheckpointFormatVersion {
        /// The index.json.
        path: PathBuf,
        /// The version the file says, `(none)` when it says none.
        found: String,
        /// The version this build reads.
        expected: u32,
    },
    /// A checkpoint whose files do not hash to the hash its index records.
    #[error(
        "checkpoint {} was changed after it was written (content hash {actual}, recorded {recorded}); save it again",
        .dir.display()
    )]
    #[diagnostic(code(E0541), help("save the checkpoint again with --save; do not edit a checkpoint's files"))]
    CheckpointHashMismatch {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The hash of the files as read.
        actual: String,
        /// The hash index.json records.
        recorded: String,
    },
    /// A checkpoint of a model whose configuration differs from the run's.
    #[error(
        "{} holds a checkpoint of {saved}, whose config differs from {model}'s in {differences}; resume with the \
         model it was saved from",
        .dir.display()
    )]
    #[diagnostic(
        code(E0542),
        help("pass the model the checkpoint was saved from, or --resume a checkpoint of this model")
    )]
    CheckpointOfAnotherModel {
        /// The checkpoint directory.
        dir: PathBuf,
        /// The model the checkpoint holds.
        saved: String,
        /// The run's model.
        model: String,
        /// The `config.json` fields that differ, `field saved -> run`.
        differences: String,
    },
    /// A checkpoint index that is not JSON of the index format.
    #[error("{} is not a pleat checkpoint index: {reason}", .path.display())]
    #[diagnostic(code(E0543), help("--resume takes a directory that `pleat run --train --save` wrote"))]
    NotACheckpoint {
        /// The index.json.
        path: PathBuf,
        /// The JSON parser's message.
        reason: String,
    },

    // === Usage ===
    /// A compiled directory given to a command that compiles.
    #[error("{model} is a compiled directory; {command} takes a preset, a config.json or a model directory")]
    #[diagnostic(code(E0702), help("give the model the directory was compiled from (its config.json is inside)"))]
    CompiledNotAccepted {
        /// The MODEL argument.
        model: String,
        /// The command.
        command: String,
    },
    /// `--layer` past the model's layers.
    #[error("--layer {layer} does not exist; {model} has {layers} layers, 0 to {}", .layers.saturating_sub(1))]
    #[diagnostic(code(E0703), help("pick a --layer below the model's num_hidden_layers"))]
    NoSuchLayer {
        /// The layer asked for.
        layer: u64,
        /// The model's name.
        model: String,
        /// The model's layers.
        layers: u64,
    },
    /// `--value` names nothing in the layer.
    #[error("no value named {name} in layer {layer}; names look like {prefix}o_proj")]
    #[diagnostic(code(E0704), help("run `pleat explain` without --value to list the layer's value names"))]
    NoSuchValue {
        /// The name asked for.
        name: String,
        /// The layer.
        layer: u64,
        /// The layer's name prefix, `layer0.`.
        prefix: String,
    },
    /// A token file that is readable JSON but not a batch of token ids.
    #[error("{}: {problem}", .path.display())]
    #[diagnostic(
        code(E0705),
        help("write the tokens as a JSON array of equal-length arrays of ids, [[1, 2, ...], ...]")
    )]
    TokensFile {
        /// The token file.
        path: PathBuf,
        /// What is wrong with it.
        problem: String,
    },
    /// A token file whose shape differs from the run's.
    #[error(
        "the tokens file holds {batch} sequences of {seq} tokens, but the run is for batch={run_batch} seq={run_seq}"
    )]
    #[diagnostic(code(E0706), help("drop --batch and --seq to take them from the tokens file, or give matching ones"))]
    TokensShape {
        /// Sequences in the file.
        batch: u64,
        /// Tokens a sequence in the file.
        seq: u64,
        /// The run's batch.
        run_batch: u64,
        /// The run's sequence length.
        run_seq: u64,
    },
    /// A flag that contradicts the compiled plan.
    #[error("{flag} {given} differs from the compiled plan's {planned}; recompile, or drop {flag}")]
    #[diagnostic(
        code(E0707),
        help("a compiled directory fixes its mesh, strategy, batch and seq; recompile to change them")
    )]
    DiffersFromPlan {
        /// The flag.
        flag: &'static str,
        /// Its value.
        given: String,
        /// The plan's value.
        planned: String,
    },
    /// `--precision` given with a compiled directory, whose programs fixed their dtypes.
    #[error("--precision cannot change {dir}: a compiled directory runs in the dtype it was compiled with")]
    #[diagnostic(code(E0780), help("drop --precision, or run the model itself (a preset or config) with it"))]
    PrecisionOfCompiled {
        /// The compiled directory.
        dir: String,
    },
    /// A count flag of zero.
    #[error("{flag} 0: give at least 1 {what}")]
    #[diagnostic(code(E0708), help("give the flag a value of at least 1"))]
    ZeroFlag {
        /// The flag.
        flag: &'static str,
        /// What it counts, singular.
        what: &'static str,
    },
    /// A rank count above what a mesh may have.
    #[error("{flag} {ranks} is more than pleat addresses ({max}); give at most {max}")]
    #[diagnostic(code(E0711), help("give the flag at most 16777216 (2^24)"))]
    TooManyRanks {
        /// The flag.
        flag: &'static str,
        /// The count given.
        ranks: u64,
        /// [`pleat_ir::Mesh::MAX_RANKS`].
        max: u64,
    },
    /// A run or benchmark that needs more memory than this machine has available.
    #[error(
        "{what} needs about {:.2} GB and this machine has {:.2} GB available; it would abort in the allocator",
        *.needed as f64 / 1e9,
        *.available as f64 / 1e9
    )]
    #[diagnostic(
        code(E0747),
        help("use a smaller model, batch, sequence or --sizes, or more ranks over more machines")
    )]
    NotEnoughMemory {
        /// What needs it.
        what: String,
        /// Bytes it needs.
        needed: u64,
        /// Bytes available.
        available: u64,
    },
    /// `pleat compare --seq` with no lengths.
    #[error("--seq needs at least one length, e.g. --seq 4096,16384")]
    #[diagnostic(code(E0709), help("list the sequence lengths to compare, separated by commas"))]
    EmptySeqList,
    /// `--chunks` with a schedule that has no chunks.
    #[error(
        "--chunks {chunks} applies to --schedule interleaved only, not to {schedule}; drop --chunks or use \
         --schedule interleaved"
    )]
    #[diagnostic(code(E0710), help("drop --chunks, or use --schedule interleaved"))]
    ChunksWithoutInterleaving {
        /// The chunks given.
        chunks: u32,
        /// The schedule named.
        schedule: String,
    },
    /// A `--sizes` range that is empty or starts at zero.
    #[error("--sizes {text}: the range must go from a positive size up to a larger one, e.g. 1KiB..4MiB")]
    #[diagnostic(code(E0712), help("write --sizes as a list (4KiB,1MiB) or a range from a smaller to a larger size"))]
    SizesRange {
        /// The argument.
        text: String,
    },
    /// A `--sizes` entry under one f32 (4 bytes).
    #[error("--sizes {text}: a size under 4 bytes (one f32 element) measures nothing of its own; give sizes of at least 4 bytes")]
    #[diagnostic(code(E0713), help("give sizes of at least 4 bytes"))]
    SizesZero {
        /// The argument.
        text: String,
    },
    /// A size with a unit pleat does not know.
    #[error("size {text}: unknown unit {unit:?}; use B, KiB, MiB or GiB")]
    #[diagnostic(code(E0714), help("write sizes like 512B, 4KiB, 16MiB or 1GiB"))]
    SizeUnit {
        /// The size.
        text: String,
        /// The unit found.
        unit: String,
    },
    /// A size whose number does not parse.
    #[error("size {text}: expected a number then a unit, e.g. 64KiB")]
    #[diagnostic(code(E0737), help("write sizes like 512B, 4KiB, 16MiB or 1GiB"))]
    SizeNumber {
        /// The size.
        text: String,
    },
    /// A size past 2^64 bytes.
    #[error("size {text} is too large; give sizes below 16EiB")]
    #[diagnostic(code(E0738), help("give a smaller size, e.g. 1GiB"))]
    SizeTooLarge {
        /// The size.
        text: String,
    },
    /// A `--tokens` id past the model's vocabulary.
    #[error("--tokens: token [{sequence}][{position}] is {id}, not an id below the model's vocabulary size {vocab}")]
    #[diagnostic(code(E0755), help("tokenize with the model's own tokenizer: its ids are below vocab_size"))]
    TokenOutsideVocabulary {
        /// The sequence.
        sequence: usize,
        /// The position in it.
        position: usize,
        /// The id.
        id: u32,
        /// The model's vocabulary size.
        vocab: u64,
    },
    /// A compiled directory whose model's weights are no longer where it was compiled from.
    #[error(
        "{} was compiled from a model whose weights were at {}, and they are gone; pass --weights, or recompile",
        .dir.display(),
        .weights.display()
    )]
    #[diagnostic(code(E0754), help("pass the model's weights with --weights, or recompile from where they are now"))]
    CompiledWeightsGone {
        /// The compiled directory.
        dir: PathBuf,
        /// The weights it recorded.
        weights: PathBuf,
    },
    /// A pipeline flag (`--chunks`, `--schedule interleaved`, `--pp-layers`) on a mesh without a
    /// pp axis, where it would change nothing.
    #[error(
        "{flag} applies to pipeline stages, and the mesh has no pp axis; add pp=2 or more to --mesh, or drop {flag}"
    )]
    #[diagnostic(code(E0753), help("add a pp axis to --mesh, e.g. pp=2, or drop the flag"))]
    PipelineFlagWithoutPp {
        /// The flag as given.
        flag: String,
    },
    /// `--virtual-stages` without a pipeline axis.
    #[error("--virtual-stages {virtual_stages} needs a pp axis in the mesh; add pp=2 or more")]
    #[diagnostic(code(E0732), help("add a pp axis to --mesh, e.g. --mesh pp=2, or drop --virtual-stages"))]
    VirtualStagesWithoutPp {
        /// The virtual stages asked for.
        virtual_stages: u64,
    },
    /// A MODEL directory that holds neither a config.json nor a compiled plan.
    #[error(
        "{model} is a directory without config.json or plan.json; give a config.json, a model directory, a \
         compiled directory or a preset ({presets})"
    )]
    #[diagnostic(
        code(E0733),
        help("point MODEL at a directory holding config.json (a Hugging Face model) or plan.json (`pleat compile`)")
    )]
    DirectoryNotAModel {
        /// The MODEL argument.
        model: String,
        /// The preset names, comma-separated.
        presets: String,
    },
    /// A MODEL that is no preset and no existing path.
    #[error(
        "MODEL `{model}` is neither a preset ({presets}) nor an existing config.json, model directory or compiled \
         directory"
    )]
    #[diagnostic(
        code(E0734),
        help("give a preset name from the list, or the path of a config.json or a model directory")
    )]
    UnknownModel {
        /// The MODEL argument.
        model: String,
        /// The preset names, comma-separated.
        presets: String,
    },
    /// An output or checkpoint path that ends in no name (`/`, `..`).
    #[error("{} names no file or directory; give a path that ends in a name", .path.display())]
    #[diagnostic(code(E0735), help("give a path whose last part is a name, e.g. out/checkpoint"))]
    PathWithoutName {
        /// The path.
        path: PathBuf,
    },
    /// An output directory that exists and is not one pleat wrote: replacing it would delete it.
    #[error(
        "{} exists and {what}; pleat replaces its output directory whole, so it will not write there",
        .path.display()
    )]
    #[diagnostic(code(E0746), help("give a new or empty directory, or remove this one yourself"))]
    OutputOccupied {
        /// The path.
        path: PathBuf,
        /// What it is instead of a pleat output.
        what: String,
    },
    /// An output path that cannot be written, found before the work whose output it is.
    #[error("{flag} {}: {problem}", .path.display())]
    #[diagnostic(
        code(E0750),
        help(
            "give a file's path in an existing directory; a directory output may be new (its missing parents are \
             made), empty or pleat-written"
        )
    )]
    OutputPath {
        /// The path.
        path: PathBuf,
        /// The flag that gave it.
        flag: &'static str,
        /// What is wrong with it.
        problem: String,
    },
    /// `search --emit-plan` whose best plan uses an axis the compiler lacks.
    #[error(
        "the best plan, {layout}, uses an axis pleat cannot compile yet; drop --all-axes for the best plan it can \
         build"
    )]
    #[diagnostic(code(E0736), help("drop --all-axes, or drop --emit-plan to only see the ranking"))]
    PlanNotCompilable {
        /// The plan's layout.
        layout: String,
    },

    // === Training ===
    /// `--strategy tp-sp-or-tsp` with `--train`.
    #[error(
        "--strategy tp-sp-or-tsp folds inference graphs only (the backward has no rule for the ring MLP); train \
         with --strategy tp-sp, or with --mesh tsp=D for TSP"
    )]
    #[diagnostic(code(E0718), help("train with --strategy tp-sp, or with --mesh tsp=D for TSP"))]
    TrainFoldedStrategy,
    /// `--zero` without a data-parallel axis.
    #[error(
        "--zero {zero} splits state over the ranks that replicate the parameters (dp, cp, and ep, which splits the \
         batch as dp does), and --mesh has none of them above 1; add one, e.g. dp=2"
    )]
    #[diagnostic(code(E0719), help("add a dp axis to --mesh (e.g. dp=2), or drop --zero"))]
    ZeroWithoutDp {
        /// The ZeRO stage asked for.
        zero: u8,
    },
    /// A directory holding a checkpoint's rank files but not its `index.json`.
    #[error(
        "{} holds rank<i>.safetensors files but no index.json: a checkpoint whose index is gone, whose \
         weights pleat cannot place",
        .dir.display()
    )]
    #[diagnostic(code(E0758), help("save the checkpoint again (--save), or resume from another one"))]
    CheckpointWithoutIndex {
        /// The directory.
        dir: PathBuf,
    },
    /// A `--data` stream (a pipe or a device) longer than pleat reads.
    #[error("--data {}: it is not a regular file, and it holds more than {limit} bytes; pleat reads a stream whole", .path.display())]
    #[diagnostic(code(E0759), help("write the token ids to a file and pass its path"))]
    DataStreamTooLarge {
        /// The path.
        path: PathBuf,
        /// The bytes read at most.
        limit: u64,
    },
    /// A flag `pleat bench overlap` cannot honour: it runs each plan both ways.
    #[error("bench overlap runs the plan blocking and scheduled, side by side, so {flag} has no meaning here")]
    #[diagnostic(code(E0756), help("drop {flag}; `pleat run --no-overlap` runs the blocking programs alone"))]
    OverlapBenchFlag {
        /// The flag.
        flag: &'static str,
    },
    /// `pleat bench overlap` on a mesh whose programs move nothing.
    #[error(
        "bench overlap measures the communication a schedule hides, and the programs of --mesh {mesh:?} make no \
         transfer"
    )]
    #[diagnostic(code(E0757), help("give a mesh that splits the model, e.g. --mesh tsp=4, tp=4 or dp=2,tp=2"))]
    OverlapBenchWithoutTransfers {
        /// The mesh given.
        mesh: String,
    },
    /// `pleat bench buckets` without a data-parallel axis.
    #[error("bench buckets compares the gradients' all-reduces over dp, and --mesh {mesh} has no dp axis above 1; add one, e.g. dp=2")]
    #[diagnostic(code(E0745), help("add a dp axis to --mesh, e.g. --mesh dp=4 or dp=2,tp=2"))]
    BucketsWithoutDp {
        /// The mesh given.
        mesh: String,
    },
    /// An interleaved pipeline with more virtual stages than the model has layers.
    #[error(
        "pp={stages} with {chunks} chunks a rank has {virtual_stages} virtual stages, one layer each at least, and \
         {model} has {layers} layers; use fewer --chunks or a smaller pp"
    )]
    #[diagnostic(code(E0791), help("lower --chunks or the pp degree, or use --schedule 1f1b"))]
    TooFewLayersForChunks {
        /// The model's name.
        model: String,
        /// Pipeline ranks.
        stages: u64,
        /// Model chunks a rank.
        chunks: u64,
        /// `stages · chunks`.
        virtual_stages: u64,
        /// The model's layers.
        layers: u64,
    },
    /// `--batch` that does not split into `--micro-batches`.
    #[error("--batch {batch} does not split into --micro-batches {micro_batches}; use a count in {valid:?}")]
    #[diagnostic(code(E0724), help("give --micro-batches a divisor of --batch"))]
    BatchNotSplit {
        /// The batch.
        batch: u64,
        /// The micro-batches asked for.
        micro_batches: u32,
        /// The counts that divide the batch.
        valid: Vec<u64>,
    },
    /// `--micro-batches` that leave each micro-batch fewer sequences, or a count that does not
    /// split, over the mesh's batch axes (dp, and ep for a mixture).
    #[error(
        "a micro-batch holds {sequences} sequences (--batch {batch} over --micro-batches {micro_batches}), \
         which do not split over {axes}; {fix}"
    )]
    #[diagnostic(
        code(E0725),
        help("give fewer micro-batches, so that each holds a multiple of the batch axes' ranks, or a larger --batch")
    )]
    MicroBatchNotSplit {
        /// The batch.
        batch: u64,
        /// The micro-batches asked for.
        micro_batches: u32,
        /// The sequences a micro-batch.
        sequences: u64,
        /// The batch axes and their degrees, e.g. `dp=2`.
        axes: String,
        /// What to give instead: the counts whose micro-batches split over them, or a batch.
        fix: String,
    },
    /// A `--data` word that is not a token id of the vocabulary.
    #[error("--data {}: token {index} is {word:?}, not an id below the vocabulary size {vocab}", .path.display())]
    #[diagnostic(code(E0726), help("write the data as integer token ids below the model's vocab_size"))]
    DataToken {
        /// The data file.
        path: PathBuf,
        /// The token's index in the file.
        index: usize,
        /// The word found.
        word: String,
        /// The model's vocabulary size.
        vocab: u64,
    },
    /// A `--data` file without tokens.
    #[error("--data {}: no token ids; write integers separated by spaces or commas", .path.display())]
    #[diagnostic(code(E0727), help("write the data as integer token ids separated by spaces or commas"))]
    DataEmpty {
        /// The data file.
        path: PathBuf,
    },
    /// `--train` given a compiled directory of forward programs.
    #[error("{} holds a forward pass (compiled without --train); --train runs a training step", .dir.display())]
    #[diagnostic(
        code(E0728),
        help("compile a training step with `pleat compile MODEL --train ... --out DIR`, or train the model itself")
    )]
    TrainOfForwardDir {
        /// The compiled directory.
        dir: PathBuf,
    },
    /// A compiled directory of training programs run without `--train`.
    #[error("{} holds a training step (compiled with --train); it runs with --train", .dir.display())]
    #[diagnostic(
        code(E0792),
        help(
            "train it with `pleat run DIR --train` (and --steps, --lr, --data as needed), or compile without --train \
             for the forward pass"
        )
    )]
    ForwardOfTrainingDir {
        /// The compiled directory.
        dir: PathBuf,
    },
    /// A flag that shapes the training programs, given with another value than a compiled
    /// directory's.
    #[error("{flag} {given} differs from {}'s compiled training step ({flag} {planned})", .dir.display())]
    #[diagnostic(
        code(E0793),
        help("a compiled directory fixes how its step is split and reduced: drop the flag, or compile again with it")
    )]
    TrainFlagDiffersFromPlan {
        /// The flag.
        flag: &'static str,
        /// Its value.
        given: String,
        /// The directory's.
        planned: String,
        /// The compiled directory.
        dir: PathBuf,
    },
    /// `pleat compile --train --emit exe`.
    #[error("--emit exe writes forward executables, which run under mpirun; a training step runs in `pleat run`")]
    #[diagnostic(
        code(E0794),
        help("emit `so` (native code on the CPU) or `ptx` (a GPU's kernels) with --train; `pleat run DIR --train` runs them")
    )]
    ExecutablesOfTraining,
    /// `--train` with `--tokens`.
    #[error("--train reads its tokens from --data (or the synthetic stream), not --tokens")]
    #[diagnostic(code(E0729), help("pass the training tokens with --data, or drop --tokens"))]
    TrainWithTokens,
    /// An inference-only flag with `--train`.
    #[error("{flag} applies to inference runs; drop it or drop --train")]
    #[diagnostic(code(E0730), help("drop the flag, or drop --train"))]
    InferenceFlagWithTrain {
        /// The flag.
        flag: &'static str,
    },
    /// `--resume` with `--weights`.
    #[error("--resume reads the checkpoint's weights; drop --weights")]
    #[diagnostic(code(E0731), help("drop --weights: a resumed run starts from the checkpoint's weights"))]
    ResumeWithWeights,

    // === MPI launches ===
    /// `pleat rank` launched with another number of processes than the directory's ranks.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code, reason = "only MPI launches raise it"))]
    #[error(
        "rank {rank}: the MPI world has {world} ranks but {} was compiled for {ranks} ranks; launch with mpirun -np \
         {ranks}",
        .dir.display()
    )]
    #[diagnostic(code(E0715), help("launch with mpirun -np equal to the compiled ranks (plan.json's `ranks`)"))]
    MpiWorldSize {
        /// This process's rank.
        rank: u32,
        /// The MPI world size.
        world: u32,
        /// The compiled directory.
        dir: PathBuf,
        /// The ranks it was compiled for.
        ranks: u32,
    },
    /// `run --comm mpi` with a flag `pleat rank` does not take.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code, reason = "only --comm mpi raises it"))]
    #[error("--comm mpi runs the forward pass of the compiled programs on the CPU (pleat rank), which takes no {flag}; drop {flag} or run with --comm threads")]
    #[diagnostic(code(E0748), help("drop the flag, or run on threads (--comm threads, the default)"))]
    NotUnderMpi {
        /// The flag.
        flag: &'static str,
    },
    /// `run --comm mpi` whose mpirun would not start.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code, reason = "only --comm mpi raises it"))]
    #[error("--comm mpi cannot start mpirun ({reason}); install Open MPI (openmpi-bin)")]
    #[diagnostic(code(E0744), help("install Open MPI, or run on threads (--comm threads, the default)"))]
    MpirunMissing {
        /// Why it did not start.
        reason: String,
    },
    /// `run --comm mpi` whose MPI job failed; its ranks reported why above.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code, reason = "only --comm mpi raises it"))]
    #[error("the MPI job of --comm mpi failed ({status}); its ranks' errors are above")]
    #[diagnostic(code(E0749), help("read the ranks' errors above; rerun with --comm threads to compare"))]
    MpiJobFailed {
        /// mpirun's exit status.
        status: String,
    },
    /// `bench comm --ranks` that differs from the MPI world.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code, reason = "only MPI launches raise it"))]
    #[error("--ranks {asked} differs from the MPI world size {world}; launch with mpirun -np {asked}")]
    #[diagnostic(code(E0716), help("drop --ranks under mpirun, or launch with mpirun -np equal to it"))]
    RanksDifferFromWorld {
        /// The ranks asked for.
        asked: u32,
        /// The MPI world size.
        world: u32,
    },
    /// A test hook variable that does not parse.
    #[cfg_attr(not(feature = "mpi"), allow(dead_code, reason = "only MPI launches raise it"))]
    #[error("{name}={value} is not <rank>:<call>, e.g. 2:3")]
    #[diagnostic(code(E0717), help("unset the variable, or write it as <rank>:<call>"))]
    ExitHookSyntax {
        /// The variable.
        name: &'static str,
        /// Its value.
        value: String,
    },

    // === Checks ===
    /// `--check` found logits off the reference.
    #[error("max |logits - reference| = {err:e} exceeds the tolerance {tolerance:e}")]
    #[diagnostic(code(E0720), help("this is a pleat bug for this mesh and strategy; report the command line"))]
    LogitsMismatch {
        /// The largest absolute difference.
        err: f32,
        /// The tolerance.
        tolerance: f32,
    },
    /// `--check`'s reference overflowed: it cannot judge the run.
    #[error(
        "the reference's logits are {value} at token [{sequence}, {position}], vocabulary entry {entry}: the \
         weights or the tokens overflow the single-device reference itself, so --check cannot judge the run"
    )]
    #[diagnostic(
        code(E0751),
        help("check the weights: a value near the dtype's largest overflows; or drop --check for these weights")
    )]
    ReferenceNotFinite {
        /// The first value that is not finite.
        value: f32,
        /// Where: the sequence, the position in it, and the vocabulary entry.
        sequence: usize,
        position: usize,
        entry: usize,
    },
    /// A training run's first step diverged: before any update, so not the learning rate's doing.
    #[error(
        "optimizer step {step}, this run's first: the gradient norm is {norm} before any update, so --lr cannot \
         be the cause: the weights as loaded or the data overflow"
    )]
    #[diagnostic(
        code(E0752),
        help(
            "check the weights (a value near the dtype's largest overflows) or the data; a checkpoint saved \
             from a diverging run needs an earlier one"
        )
    )]
    DivergedBeforeUpdate {
        /// The step.
        step: u32,
        /// The gradient norm.
        norm: f64,
    },
    /// `pleat demo`'s check failed.
    #[error("the tp=4 logits differ from the reference by {err:e}")]
    #[diagnostic(code(E0721), help("this is a pleat bug; report the output of `pleat demo`"))]
    DemoMismatch {
        /// The largest absolute difference.
        err: f32,
    },
    /// A benchmark rank's thread panicked.
    #[error("a rank's thread panicked")]
    #[diagnostic(code(E0722), help("this is a pleat bug; report the command line"))]
    RankPanicked,
    /// A benchmarked collective computed a wrong result.
    #[error(
        "{op} of {elements} elements gave a wrong result at element {element} on rank {rank}: got {got}, expected \
         {expected}"
    )]
    #[diagnostic(code(E0723), help("this is a pleat bug in the communicator; report the command line"))]
    CollectiveWrongResult {
        /// The collective.
        op: &'static str,
        /// Its element count.
        elements: usize,
        /// The first wrong element.
        element: usize,
        /// The rank that saw it.
        rank: u32,
        /// The value received.
        got: f32,
        /// The value expected.
        expected: f32,
    },
    /// `pleat run --train --check` found a quantity off the reference.
    #[error("{quantity} from the reference, {err:e}, exceeds the tolerance {tolerance:e}")]
    #[diagnostic(code(E0739), help("this is a pleat bug for this mesh and strategy; report the command line"))]
    TrainCheckMismatch {
        /// What was compared.
        quantity: &'static str,
        /// The difference.
        err: f32,
        /// The tolerance.
        tolerance: f32,
    },
    /// No rank's training program returned the loss.
    #[error("no rank's program returns the loss")]
    #[diagnostic(code(E0740), help("this is a pleat bug; report the command line"))]
    NoLossRank,
    /// An outcome of a rank that has no program.
    #[error("rank {rank} has no program among the {programs} given")]
    #[diagnostic(code(E0741), help("this is a pleat bug; report the command line"))]
    RankWithoutProgram {
        /// The outcome's rank.
        rank: u32,
        /// The programs given.
        programs: usize,
    },
    /// The programs returned no logits.
    #[error("the programs returned no logits")]
    #[diagnostic(code(E0742), help("this is a pleat bug; report the command line"))]
    NoLogits,
}

impl UsageError {
    /// The file or flag at fault, as `(key, value)` pairs for the error's location.
    pub fn location(&self) -> Vec<(&'static str, String)> {
        match self {
            UsageError::PlanFormatVersion { path, .. }
            | UsageError::PlanHashMismatch { path, .. }
            | UsageError::NativeFileChanged { path, .. }
            | UsageError::CompiledFileUnreadable { path, .. }
            | UsageError::NotAPlan { path, .. }
            | UsageError::SearchPlanVersion { path, .. }
            | UsageError::UnknownPlanStrategy { path, .. }
            | UsageError::TokensFile { path, .. }
            | UsageError::CheckpointFormatVersion { path, .. }
            | UsageError::NotACheckpoint { path, .. }
            | UsageError::PathWithoutName { path }
            | UsageError::OutputOccupied { path, .. }
            | UsageError::DataToken { path, .. }
            | UsageError::DataEmpty { path } => vec![("file", path.display().to_string())],
            UsageError::CheckpointHashMismatch { dir, .. } | UsageError::CheckpointOfAnotherModel { dir, .. } => {
                vec![("file", dir.display().to_string())]
            }
            UsageError::DirectoryNotAModel { model, .. } => vec![("file", model.clone())],
            UsageError::TrainOfForwardDir { dir } | UsageError::ForwardOfTrainingDir { dir } => {
                vec![("file", dir.display().to_string())]
            }
            UsageError::OutputPath { path, flag, .. } => {
                vec![("flag", flag.to_string()), ("file", path.display().to_string())]
            }
            UsageError::TrainFlagDiffersFromPlan { flag, dir, .. } => {
                vec![("flag", flag.to_string()), ("file", dir.display().to_string())]
            }
            UsageError::ExecutablesOfTraining => vec![("flag", "--emit".to_string())],
            UsageError::NativeOfCompiled { dir } => vec![("flag", "--native".to_string()), ("file", dir.clone())],
            UsageError::PrecisionOfCompiled { dir } => vec![("flag", "--precision".to_string()), ("file", dir.clone())],
            UsageError::UnknownModel { model, .. } => {
                vec![("model", model.clone())]
            }
            UsageError::SizeNumber { .. } | UsageError::SizeTooLarge { .. } => vec![("flag", "--sizes".to_string())],
            UsageError::VirtualStagesWithoutPp { .. } => vec![("flag", "--virtual-stages".to_string())],
            UsageError::PipelineFlagWithoutPp { flag } => vec![("flag", flag.clone())],
            UsageError::OverlapBenchFlag { flag } => vec![("flag", flag.to_string())],
            UsageError::CheckpointWithoutIndex { dir } => vec![("file", dir.display().to_string())],
            UsageError::DataStreamTooLarge { path, .. } => {
                vec![("flag", "--data".to_string()), ("file", path.display().to_string())]
            }
            UsageError::OverlapBenchWithoutTransfers { .. } => vec![("flag", "--mesh".to_string())],
            UsageError::CompiledWeightsGone { weights, .. } => vec![("file", weights.display().to_string())],
            UsageError::TokenOutsideVocabulary { .. } => vec![("flag", "--tokens".to_string())],
            UsageError::PlanNotCompilable { .. } => vec![("flag", "--all-axes".to_string())],
            UsageError::TrainFoldedStrategy => vec![("flag", "--strategy".to_string())],
            UsageError::ZeroWithoutDp { .. } => vec![("flag", "--zero".to_string())],
            UsageError::BucketsWithoutDp { mesh } => vec![("mesh", mesh.clone())],
            UsageError::BatchNotSplit { .. } | UsageError::MicroBatchNotSplit { .. } => {
                vec![("flag", "--micro-batches".to_string())]
            }
            UsageError::TrainWithTokens => vec![("flag", "--tokens".to_string())],
            UsageError::InferenceFlagWithTrain { flag } => vec![("flag", flag.to_string())],
            UsageError::ResumeWithWeights => vec![("flag", "--weights".to_string())],
            UsageError::RankWithoutProgram { rank, .. } => vec![("rank", rank.to_string())],
            UsageError::StrategyNeedsAxis { .. } => vec![("flag", "--strategy".to_string())],
            UsageError::NoSuchLayer { .. } => vec![("flag", "--layer".to_string())],
            UsageError::NoSuchValue { .. } => vec![("flag", "--value".to_string())],
            UsageError::DiffersFromPlan { flag, .. }
            | UsageError::ZeroFlag { flag, .. }
            | UsageError::TooManyRanks { flag, .. } => {
                vec![("flag", flag.to_string())]
            }
            UsageError::EmptySeqList => vec![("flag", "--seq".to_string())],
            UsageError::ChunksWithoutInterleaving { .. } | UsageError::TooFewLayersForChunks { .. } => {
                vec![("flag", "--chunks".to_string())]
            }
            UsageError::SizesRange { .. } | UsageError::SizesZero { .. } | UsageError::SizeUnit { .. } => {
                vec![("flag", "--sizes".to_string())]
            }
            UsageError::CudaUnavailable => vec![("flag", "--device".to_string())],
            UsageError::CpuOnlyFlag { flag } => vec![("flag", flag.to_string())],
            UsageError::WarmupWithoutCuda => vec![("flag", "--warmup".to_string())],
            UsageError::NativeUnavailable | UsageError::RuntimeLibraryNotFound { .. } => {
                vec![("flag", "--emit".to_string())]
            }
            UsageError::ExecutablesIncomplete { dir, .. } | UsageError::ExecutablesFailed { dir, .. } => {
                vec![("file", dir.clone())]
            }
            UsageError::NotLaunchable { dir, .. } => vec![("file", dir.clone())],
            UsageError::CompiledNotAccepted { model, .. } => vec![("file", model.clone())],
            UsageError::MpiWorldSize { dir, .. } => vec![("file", dir.display().to_string())],
            UsageError::RanksDifferFromWorld { .. } => vec![("flag", "--ranks".to_string())],
            UsageError::NotUnderMpi { flag } => vec![("flag", flag.to_string())],
            UsageError::MpirunMissing { .. } | UsageError::MpiJobFailed { .. } => vec![("flag", "--comm".to_string())],
            UsageError::ExitHookSyntax { name, .. } => vec![("variable", name.to_string())],
            UsageError::ProgramsStuck { .. }
            | UsageError::OverlapChangedNumbers
            | UsageError::TokensShape { .. }
            | UsageError::LogitsMismatch { .. }
            | UsageError::ReferenceNotFinite { .. }
            | UsageError::DivergedBeforeUpdate { .. }
            | UsageError::DemoMismatch { .. }
            | UsageError::RankPanicked
            | UsageError::CollectiveWrongResult { .. }
            | UsageError::TrainCheckMismatch { .. }
            | UsageError::NoLossRank
            | UsageError::NoLogits
            | UsageError::NotEnoughMemory { .. } => Vec::new(),
        }
    }
}
