//! The errors of the reference interpreter.
//!
//! `OpError` is what an op reports about its operand tensors alone; it knows no graph, so the same
//! op functions can later run on each rank's local blocks. `InterpError` is what `run` reports: it
//! names the node (`n12`) and its name, and wraps an `OpError` where an op failed.

use crate::{NodeId, ValueId};

/// A failure of one op on its operand tensors.
#[derive(Clone, Debug, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum OpError {
    // === Operands ===
    /// The op got the wrong number of operands.
    #[error("takes {expected} operands, got {got}; fix the node's inputs")]
    #[diagnostic(code(E0430), help("give the node the op's number of operands"))]
    Arity {
        /// The op's arity.
        expected: usize,
        /// The operands given.
        got: usize,
    },
    /// An operand whose data does not have one element for each index of its shape.
    #[error("operand {operand} has shape {shape:?} but {len} elements; build tensors with one element per index")]
    #[diagnostic(code(E0431), help("build tensors with one element per index of their shape"))]
    Inconsistent {
        /// The operand's position.
        operand: usize,
        /// Its shape.
        shape: Vec<usize>,
        /// Its element count.
        len: usize,
    },
    /// An operand whose shape the op cannot take.
    #[error("operand {operand} has shape {shape:?}, expected {expected}; fix the graph's types")]
    #[diagnostic(code(E0432), help("fix the graph's value types"))]
    OperandShape {
        /// The operand's position.
        operand: usize,
        /// Its shape.
        shape: Vec<usize>,
        /// The shape the op needs, in words (`[vocab, hidden]`, `[seq] with seq = 6`).
        expected: String,
    },
    /// A token id or position that is not an exact integer in `0..2^24`.
    #[error(
        "operand {operand} element {index:?} is {value}, not an integer in 0..16777216; token ids and positions \
         must be exact non-negative integers"
    )]
    #[diagnostic(code(E0433), help("pass token ids and positions as exact integers below 2^24"))]
    NotAnIndex {
        /// The operand's position.
        operand: usize,
        /// The element's multi-index.
        index: Vec<usize>,
        /// The element.
        value: f32,
    },

    // === Model ===
    /// A token id outside the embedding table.
    #[error("token {token} at index {index:?} is outside the vocabulary of {vocab}; check that the tokenizer matches the model")]
    #[diagnostic(code(E0434), help("use a tokenizer that matches the model's vocabulary"))]
    TokenOutOfRange {
        /// The token's multi-index in the token tensor (`[batch, seq]`).
        index: Vec<usize>,
        /// The token id.
        token: usize,
        /// The vocabulary size (rows of the table).
        vocab: usize,
    },
    /// A rotary-embedding setting that gives no meaningful frequencies.
    #[error("rope setting {field} is {value}; it must be positive and finite, fix rope_theta or rope_scaling in config.json")]
    #[diagnostic(code(E0435), help("make rope_theta and rope_scaling positive and finite in config.json"))]
    RopeSetting {
        /// The setting (`rope_theta`, `factor`, ...).
        field: &'static str,
        /// Its value.
        value: f64,
    },
    /// An op whose result is not a function of its operands alone (inputs, parameters,
    /// communication): the driver evaluates it, never the op table.
    #[error("is not a function of its operand tensors; evaluate it in the interpreter's driver")]
    #[diagnostic(code(E0436), help("evaluate this op in the interpreter's driver"))]
    NotLocal,
}

/// A failure of a whole interpreter run.
#[derive(Clone, Debug, PartialEq, thiserror::Error, miette::Diagnostic)]
pub enum InterpError {
    // === Graph ===
    /// A node the unsharded interpreter cannot run: a communication or layout op, or a value whose
    /// spec is not replicated.
    #[error(
        "{node} ({name}): {detail}; the reference interpreter runs unsharded graphs only (every spec replicated, \
         no communication ops), so interpret the graph before the sharding passes"
    )]
    #[diagnostic(code(E0420), help("interpret the graph before the sharding passes"))]
    Sharded {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// What makes it sharded (`op all_reduce moves data between ranks`, `v3 is split over tp on dim 2 (ffn)`).
        detail: String,
    },
    /// An operand read before any node in the program order computed it.
    #[error("{node} ({name}): operand {value} is not computed before this node; define every operand earlier in the program order")]
    #[diagnostic(code(E0421), help("define every operand earlier in the program order"))]
    Undefined {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// The operand.
        value: ValueId,
    },
    /// A graph output that no node in the program order computes.
    #[error("graph output {value} is not computed by any node in the program order; add its node to the order")]
    #[diagnostic(code(E0422), help("add the output's node to the program order"))]
    MissingOutput {
        /// The output.
        value: ValueId,
    },
    /// A node whose computed shape differs from the type the graph declares for its value.
    #[error(
        "{node} ({name}): computed shape {computed:?} but the graph declares {declared:?}; fix the node's result type"
    )]
    #[diagnostic(code(E0423), help("fix the node's result type"))]
    ResultShape {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// The shape the op produced.
        computed: Vec<usize>,
        /// The shape of the value's type.
        declared: Vec<usize>,
    },

    // === Inputs ===
    /// Token ids or positions whose count differs from the graph's shape.
    #[error("{node} ({name}): {input} has {got} entries but the graph needs {expected} (shape {shape:?}); pass one entry per element")]
    #[diagnostic(code(E0424), help("pass one token (or position) per element of the graph's input"))]
    InputLength {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// `tokens` or `positions`.
        input: &'static str,
        /// The element count of the graph's shape.
        expected: usize,
        /// The entries given.
        got: usize,
        /// The graph's shape.
        shape: Vec<usize>,
    },
    /// A token id or position that f32 cannot hold exactly.
    #[error("{node} ({name}): {input} entry {index} is {value}, at or above 2^24 = 16777216, which f32 cannot hold exactly; use smaller ids")]
    #[diagnostic(code(E0425), help("use ids below 2^24"))]
    InputTooLarge {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// `tokens` or `positions`.
        input: &'static str,
        /// The entry's index.
        index: usize,
        /// The entry.
        value: u32,
    },
    /// A parameter the caller's lookup does not have.
    #[error("{node} ({name}): parameter `{param}` with shape {shape:?} is missing; supply it from a checkpoint that matches the config")]
    #[diagnostic(code(E0426), help("supply the parameter from a checkpoint that matches the config"))]
    MissingParam {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// The checkpoint name.
        param: String,
        /// The shape the graph expects.
        shape: Vec<u64>,
    },
    /// A parameter whose element count differs from the graph's shape.
    #[error(
        "{node} ({name}): parameter `{param}` has {got} elements but shape {shape:?} needs {expected}; check that the \
         checkpoint matches the config"
    )]
    #[diagnostic(code(E0427), help("use a checkpoint that matches the config"))]
    ParamLength {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// The checkpoint name.
        param: String,
        /// The shape the graph expects.
        shape: Vec<u64>,
        /// The element count of that shape.
        expected: usize,
        /// The elements supplied.
        got: usize,
    },

    // === Ops ===
    /// An op that failed on its operands.
    #[error("{node} ({name}): {op}: {error}")]
    #[diagnostic(code(E0428), help("fix the named node's operands"))]
    Op {
        /// The node.
        node: NodeId,
        /// Its name.
        name: String,
        /// The op's mnemonic.
        op: &'static str,
        /// What went wrong.
        error: OpError,
    },
}
