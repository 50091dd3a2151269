//! The error of the text parser: where in the text, and what was expected there.
//!
//! A `ParseError` names its place three ways: line and column for people (both from 1, the column in
//! characters), and a byte `offset` and `len` into the parsed text for miette, which underlines the
//! span when the error carries the text (`parse_module` attaches it).

use std::sync::Arc;

use miette::{Diagnostic, LabeledSpan, SourceCode};

/// A place in the parsed text.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub(crate) struct Span {
    /// The line, from 1.
    pub line: usize,
    /// The column in characters, from 1.
    pub column: usize,
    /// The byte offset into the whole text.
    pub offset: usize,
    /// The byte length.
    pub len: usize,
}

/// Text that does not parse as a module, with the place and a message saying what was expected.
#[derive(Clone, PartialEq, Eq, thiserror::Error)]
#[error("line {line}, column {column}: {message}")]
pub struct ParseError {
    /// The line, from 1.
    pub line: usize,
    /// The column in characters, from 1.
    pub column: usize,
    /// The byte offset of the offending text.
    pub offset: usize,
    /// The byte length of the offending text (0 at the end of a line).
    pub len: usize,
    /// What was expected and what was found, lowercase, without the place.
    pub message: String,
    /// The parsed text, for miette to quote.
    source_code: Option<Arc<str>>,
}

impl ParseError {
    /// An error at `span`.
    pub(crate) fn at(span: Span, message: impl Into<String>) -> ParseError {
        ParseError {
            line: span.line,
            column: span.column,
            offset: span.offset,
            len: span.len,
            message: message.into(),
            source_code: None,
        }
    }

    /// This error carrying `source`, which its span points into.
    pub(crate) fn with_source(mut self, source: &str) -> ParseError {
        self.source_code = Some(Arc::from(source));
        self
    }
}

// By hand, so a debug print shows the place and message rather than the whole parsed text.
impl std::fmt::Debug for ParseError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ParseError")
            .field("line", &self.line)
            .field("column", &self.column)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("message", &self.message)
            .finish_non_exhaustive()
    }
}

// By hand, because the span is two plain fields the caller can read, not a miette type.
impl Diagnostic for ParseError {
    fn code<'a>(&'a self) -> Option<Box<dyn std::fmt::Display + 'a>> {
        Some(Box::new("E0301"))
    }

    fn help<'a>(&'a self) -> Option<Box<dyn std::fmt::Display + 'a>> {
        Some(Box::new("fix the text at the line and column shown; `pleat compile` writes module.pleat in this syntax"))
    }

    fn source_code(&self) -> Option<&dyn SourceCode> {
        self.source_code.as_ref().map(|source| source as &dyn SourceCode)
    }

    fn labels(&self) -> Option<Box<dyn Iterator<Item = LabeledSpan> + '_>> {
        Some(Box::new(std::iter::once(LabeledSpan::underline((self.offset, self.len)))))
    }
}
