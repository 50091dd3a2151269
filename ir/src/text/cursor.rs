//! A cursor over one line of IR text: tokens with their places, and errors that say what was found.
//!
//! Every token reader first skips spaces and tabs, so hand-written text may space tokens freely; the
//! printer's canonical spacing is only one of the accepted forms. The cursor never slices inside a
//! character, so it cannot panic on any UTF-8 input.

use super::error::{ParseError, Span};

/// The result of parsing.
pub(crate) type Parsed<T> = Result<T, ParseError>;

/// A position within one line, and the line's place in the whole text.
pub(crate) struct Cursor<'a> {
    /// The line (or the part of it this cursor may read), without its line break.
    text: &'a str,
    /// The byte position within `text`.
    pos: usize,
    /// The byte offset of the line's start in the whole text.
    line_offset: usize,
    /// The line number, from 1.
    line_number: usize,
}

/// Whether `c` may appear in a word: ids, names of ops, dims, axes and keys, and integers.
fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

impl<'a> Cursor<'a> {
    /// A cursor at the start of `text`, line `line_number` of a text in which it starts at `line_offset`.
    pub fn new(text: &'a str, line_offset: usize, line_number: usize) -> Cursor<'a> {
        Cursor { text, pos: 0, line_offset, line_number }
    }

    /// A cursor over bytes `start..end` of this cursor's line (a token to parse further).
    pub fn sub(&self, start: usize, end: usize) -> Cursor<'a> {
        Cursor { text: &self.text[..end], pos: start, line_offset: self.line_offset, line_number: self.line_number }
    }

    /// The byte position within the line.
    pub fn pos(&self) -> usize {
        self.pos
    }

    /// The text not yet read.
    pub fn rest(&self) -> &'a str {
        &self.text[self.pos..]
    }

    /// The place of bytes `start..end` of the line.
    pub fn span(&self, start: usize, end: usize) -> Span {
        Span {
            line: self.line_number,
            column: self.text[..start].chars().count() + 1,
            offset: self.line_offset + start,
            len: end - start,
        }
    }

    /// Skips spaces and tabs.
    pub fn skip_spaces(&mut self) {
        let rest = self.rest();
        self.pos += rest.len() - rest.trim_start_matches([' ', '\t']).len();
    }

    /// Whether only spaces remain.
    pub fn at_end(&mut self) -> bool {
        self.skip_spaces();
        self.pos == self.text.len()
    }

    /// The next token as an error shows it: a word, a quoted string's start, one character, or the end.
    fn next_token(&mut self) -> (Span, String) {
        self.skip_spaces();
        let rest = self.rest();
        let word_len = rest.len() - rest.trim_start_matches(is_word_char).len();
        let len = match rest.chars().next() {
            None => return (self.span(self.pos, self.pos), "end of line".to_string()),
            Some(_) if word_len > 0 => word_len,
            Some(c) => c.len_utf8(),
        };
        (self.span(self.pos, self.pos + len), format!("`{}`", &rest[..len]))
    }

    /// An error at the next token: "expected {expected}, found {token}".
    pub fn expected(&mut self, expected: &str) -> ParseError {
        let (span, found) = self.next_token();
        ParseError::at(span, format!("expected {expected}, found {found}"))
    }

    /// An error at bytes `start..end` of the line.
    pub fn error(&self, start: usize, end: usize, message: impl Into<String>) -> ParseError {
        ParseError::at(self.span(start, end), message)
    }

    /// Reads `symbol` if it comes next.
    pub fn eat(&mut self, symbol: &str) -> bool {
        self.skip_spaces();
        if self.rest().starts_with(symbol) {
            self.pos += symbol.len();
            true
        } else {
            false
        }
    }

    /// Reads `symbol`, or fails saying it was expected (`what` says where, e.g. "after the value id").
    pub fn expect(&mut self, symbol: &str, what: &str) -> Parsed<()> {
        if self.eat(symbol) {
            Ok(())
        } else {
            Err(self.expected(&format!("`{symbol}` {what}")))
        }
    }

    /// Reads the word `keyword` if it comes next as a whole word.
    pub fn eat_keyword(&mut self, keyword: &str) -> bool {
        self.skip_spaces();
        let rest = self.rest();
        let is_whole_word = rest.strip_prefix(keyword).is_some_and(|after| !after.starts_with(is_word_char));
        if is_whole_word {
            self.pos += keyword.len();
            true
        } else {
            false
        }
    }

    /// Reads a word (letters, digits, `_`), failing with "expected {expected}" when none comes next.
    pub fn word(&mut self, expected: &str) -> Parsed<(&'a str, usize)> {
        self.skip_spaces();
        let rest = self.rest();
        let len = rest.len() - rest.trim_start_matches(is_word_char).len();
        if len == 0 {
            return Err(self.expected(expected));
        }
        let start = self.pos;
        self.pos += len;
        Ok((&rest[..len], start))
    }

    /// Reads an id spelled `prefix` and a number (`v3`, `n3`); `expected` describes it for errors.
    pub fn id(&mut self, prefix: char, expected: &str) -> Parsed<(usize, Span)> {
        let (word, start) = self.word(expected)?;
        let span = self.span(start, self.pos);
        let digits = word.strip_prefix(prefix).filter(|digits| digits.bytes().all(|byte| byte.is_ascii_digit()));
        match digits {
            Some(digits) if !digits.is_empty() => match digits.parse::<usize>() {
                Ok(number) => Ok((number, span)),
                Err(_) => Err(ParseError::at(span, format!("id `{word}` is too large; ids count the nodes from 0"))),
            },
            _ => Err(ParseError::at(span, format!("expected {expected}, found `{word}`"))),
        }
    }

    /// Reads a whole number of type `T` (`what` names it for errors: "the size of dim `seq`").
    pub fn integer<T: std::str::FromStr>(&mut self, what: &str) -> Parsed<T> {
        let (word, start) = self.word(&format!("a whole number for {what}"))?;
        word.parse()
            .map_err(|_| self.error(start, self.pos, format!("expected a whole number for {what}, found `{word}`")))
    }

    /// Reads a token up to a space, a tab, `#` or end of line (a bare attribute value).
    pub fn bare_token(&mut self) -> (&'a str, usize) {
        self.skip_spaces();
        let rest = self.rest();
        let len = rest.find([' ', '\t', '#']).unwrap_or(rest.len());
        let start = self.pos;
        self.pos += len;
        (&rest[..len], start)
    }

    /// Reads a token up to a space, a tab, `,` or `)` (a number inside parentheses).
    pub fn list_item(&mut self) -> (&'a str, usize) {
        self.skip_spaces();
        let rest = self.rest();
        let len = rest.find([' ', '\t', ',', ')']).unwrap_or(rest.len());
        let start = self.pos;
        self.pos += len;
        (&rest[..len], start)
    }

    /// Reads a `"`-quoted string at the cursor, undoing the printer's escapes.
    pub fn quoted(&mut self) -> Parsed<String> {
        self.skip_spaces();
        let open = self.pos;
        if !self.eat("\"") {
            return Err(self.expected("a quoted string"));
        }
        let mut text = String::new();
        loop {
            let Some(c) = self.rest().chars().next() else {
                return Err(self.error(open, open + 1, "unterminated string; end it with `\"`"));
            };
            self.pos += c.len_utf8();
            match c {
                '"' => return Ok(text),
                '\\' => text.push(self.escape(true)?),
                c => text.push(c),
            }
        }
    }

    /// Reads what follows a node id in the comment: nothing (an empty name), or one space and the
    /// name, which is the rest of the line.
    pub fn node_name(&mut self) -> Parsed<String> {
        match self.rest().chars().next() {
            Some(' ') => {}
            Some(c) => {
                // Not `expected`, which would skip a tab and blame the name after it.
                let message =
                    format!("expected a space and the node name after the node id, found `{}`", c.escape_debug());
                return Err(self.error(self.pos, self.pos + c.len_utf8(), message));
            }
            None => return Ok(String::new()),
        }
        self.pos += 1;
        self.rest_unescaped()
    }

    /// Reads the rest of the line as an unquoted name, undoing the printer's escapes.
    pub fn rest_unescaped(&mut self) -> Parsed<String> {
        let mut text = String::new();
        while let Some(c) = self.rest().chars().next() {
            self.pos += c.len_utf8();
            if c == '\\' {
                text.push(self.escape(false)?);
            } else {
                text.push(c);
            }
        }
        Ok(text)
    }

    /// Reads the character after a `\` (already read); `\"` is an escape only inside quotes.
    fn escape(&mut self, quoted: bool) -> Parsed<char> {
        let start = self.pos - 1;
        let next = self.rest().chars().next();
        let escaped = match next {
            Some('\\') => '\\',
            Some('n') => '\n',
            Some('r') => '\r',
            Some('"') if quoted => '"',
            _ => {
                let end = self.pos + next.map_or(0, char::len_utf8);
                let escapes = if quoted { r#"\\, \", \n and \r"# } else { r"\\, \n and \r" };
                return Err(self.error(
                    start,
                    end,
                    format!(
                        "unknown escape `{}`; escapes are {escapes} (write `\\\\` for a backslash)",
                        &self.text[start..end]
                    ),
                ));
            }
        };
        self.pos += 1;
        Ok(escaped)
    }
}
