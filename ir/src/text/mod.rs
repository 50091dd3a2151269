//! The IR text format: the one way a module is shown to people and read back from files.
//!
//! `print_module` is the only code that formats IR; snapshot tests and `--dump-after` show its
//! output. It is deterministic: nodes come in program order, one line each, never in hash order.
//! `parse_module` reads it back, and the two are inverse: `parse_module(&print_module(m)) == m` for
//! every well-formed module, and `print_module(&parse_module(s)?) == s` for every canonical text.
//!
//! ```text
//! ; module tiny mesh=tp=2
//! v0: i32[batch=8, seq=64] = tokens()   # n0 tokens
//! v2: f32[vocab=256/tp, hidden=128] = param() name="model.embed_tokens.weight"   # n2 model.embed_tokens.weight
//! v3: f32[batch=8, seq=64, hidden=128] partial(tp) = embedding(v2, v0)   # n3 embed
//! v4: f32[batch=8, seq=64, hidden=128] = all_reduce(v3) axis=tp   # n4 embed.all_reduce
//! outputs(v4)
//! ```
//!
//! - Line `i` of the program defines value `vi` with node `ni`; lines follow the program order, so ids
//!   need not increase down the page (passes insert nodes), but they run over `0..n` exactly once.
//! - A type is the dtype and the dims `name=size`, each followed by `/axis` for every mesh axis that
//!   splits it (outer axis first), then ` partial(ax1,ax2)` when the value is a pending sum.
//! - Attributes follow the operands as `key=value`, in a fixed order per op. Floats print with Rust's
//!   `{}` (the shortest text that reads back to the same `f64`); strings are quoted, with `\"`, `\\`,
//!   `\n` and `\r` escaped.
//! - `# n<id> <name>` ends the line; the name is the rest of the line (with `\\`, `\n` and `\r`
//!   escaped, so any name round-trips). Three spaces precede `#`; there is no column alignment, so a
//!   change to one line never shifts the others in a diff.
//! - `outputs(..)` lists the graph outputs. Nodes that exist but are outside the program order come
//!   after it, each line prefixed by `detached`.
//! - The header `; module NAME mesh=MESH` is required; other lines starting with `;` are comments,
//!   and blank lines are ignored. [`Annotate`] uses such comments to show analyses beside the IR.
//!
//! The parser checks syntax and structure (ids, arity, that operands name defined values); whether
//! shapes and specs make sense is the verifier's job, so files that test the verifier still parse.
//! It never panics: every problem is a [`ParseError`] with a byte span that miette can underline.

mod cursor;
mod error;
mod parse;
mod print;

#[cfg(test)]
mod generate;
#[cfg(test)]
mod tests;

pub use error::ParseError;
pub use parse::parse_module;
pub use print::{print_graph, print_module, print_module_annotated, print_node, Annotate};
