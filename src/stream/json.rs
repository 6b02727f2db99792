//! JSON message text for JSON streams.
//!
//! A JSON stream keeps every message as its writer wrote it, minus insignificant whitespace:
//! member order, duplicate members, number spelling (`1.50e3`, `1e400`) and string escapes
//! (unpaired surrogates included) survive byte for byte. So this is a syntax checker that
//! copies, not a parser that re-serializes: RFC 8259 grammar, UTF-8 text, at most
//! `MAX_NESTING` levels per message. A top-level array is split one level into messages.

/// The deepest a message may nest (`[]` and `{}` each count one level).
pub(crate) const MAX_NESTING: usize = 127;

/// Why a body is not acceptable JSON message text.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JsonTextError {
    /// The body is not UTF-8.
    #[error("body is not valid UTF-8")]
    Utf8,
    /// The body is not JSON.
    #[error("invalid JSON at byte {offset}: {reason}")]
    Syntax {
        /// Byte offset of the problem.
        offset: usize,
        /// What is wrong there.
        reason: &'static str,
    },
    /// A message nests deeper than `MAX_NESTING`.
    #[error("a JSON message nests deeper than {MAX_NESTING} levels")]
    TooDeep,
    /// `[]` appends no message.
    #[error("an empty JSON array appends no message")]
    EmptyArray,
}

/// Splits a JSON body into message texts, each compacted (no insignificant whitespace).
///
/// A top-level array yields one message per element; any other value is one message. An
/// empty array yields no message (the caller decides whether that is allowed).
///
/// ```
/// use sluice::stream::json::split_messages;
/// let messages = split_messages(br#"[ {"a" : 1.50e3}, "x\ud800" ]"#).unwrap();
/// assert_eq!(messages, vec![br#"{"a":1.50e3}"#.to_vec(), br#""x\ud800""#.to_vec()]);
/// ```
pub fn split_messages(body: &[u8]) -> Result<Vec<Vec<u8>>, JsonTextError> {
    if std::str::from_utf8(body).is_err() {
        return Err(JsonTextError::Utf8);
    }
    let mut p = Parser {
        input: body,
        pos: 0,
    };
    p.skip_ws();
    let mut messages = Vec::new();
    if p.peek() == Some(b'[') {
        p.pos += 1;
        p.skip_ws();
        if p.peek() == Some(b']') {
            p.pos += 1;
        } else {
            loop {
                let mut out = Vec::new();
                p.value(&mut out, 0)?;
                messages.push(out);
                p.skip_ws();
                match p.next() {
                    Some(b',') => p.skip_ws(),
                    Some(b']') => break,
                    _ => return Err(p.syntax("expected ',' or ']' in array")),
                }
            }
        }
    } else {
        let mut out = Vec::new();
        p.value(&mut out, 0)?;
        messages.push(out);
    }
    p.skip_ws();
    if p.pos != body.len() {
        return Err(p.syntax("unexpected data after the JSON value"));
    }
    Ok(messages)
}

struct Parser<'a> {
    input: &'a [u8],
    pos: usize,
}

impl Parser<'_> {
    fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.pos += 1;
        Some(b)
    }

    fn syntax(&self, reason: &'static str) -> JsonTextError {
        JsonTextError::Syntax {
            offset: self.pos,
            reason,
        }
    }

    fn skip_ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.pos += 1;
        }
    }

    /// Copies one value to `out`; `depth` is the nesting of its container.
    fn value(&mut self, out: &mut Vec<u8>, depth: usize) -> Result<(), JsonTextError> {
        self.skip_ws();
        match self.peek() {
            Some(b'{') => self.object(out, depth + 1),
            Some(b'[') => self.array(out, depth + 1),
            Some(b'"') => self.string(out),
            Some(b'-' | b'0'..=b'9') => self.number(out),
            Some(b't') => self.literal(out, b"true"),
            Some(b'f') => self.literal(out, b"false"),
            Some(b'n') => self.literal(out, b"null"),
            Some(_) => Err(self.syntax("expected a JSON value")),
            None => Err(self.syntax("unexpected end of input")),
        }
    }

    fn object(&mut self, out: &mut Vec<u8>, depth: usize) -> Result<(), JsonTextError> {
        if depth > MAX_NESTING {
            return Err(JsonTextError::TooDeep);
        }
        self.pos += 1;
        out.push(b'{');
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            out.push(b'}');
            return Ok(());
        }
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.syntax("expected a string key"));
            }
            self.string(out)?;
            self.skip_ws();
            if self.next() != Some(b':') {
                return Err(self.syntax("expected ':' after a key"));
            }
            out.push(b':');
            self.value(out, depth)?;
            self.skip_ws();
            match self.next() {
                Some(b',') => out.push(b','),
                Some(b'}') => {
                    out.push(b'}');
                    return Ok(());
                }
                _ => return Err(self.syntax("expected ',' or '}' in object")),
            }
        }
    }

    fn array(&mut self, out: &mut Vec<u8>, depth: usize) -> Result<(), JsonTextError> {
        if depth > MAX_NESTING {
            return Err(JsonTextError::TooDeep);
        }
        self.pos += 1;
        out.push(b'[');
        self.skip_ws();
        if self.peek() == Some(b']') {
            self.pos += 1;
            out.push(b']');
            return Ok(());
        }
        loop {
            self.value(out, depth)?;
            self.skip_ws();
            match self.next() {
                Some(b',') => out.push(b','),
                Some(b']') => {
                    out.push(b']');
                    return Ok(());
                }
                _ => return Err(self.syntax("expected ',' or ']' in array")),
            }
        }
    }

    /// Copies a string verbatim after checking its escapes and control characters. The
    /// input is known to be UTF-8, so multi-byte characters need no further check.
    fn string(&mut self, out: &mut Vec<u8>) -> Result<(), JsonTextError> {
        let start = self.pos;
        self.pos += 1;
        loop {
            match self.next() {
                None => return Err(self.syntax("unterminated string")),
                Some(b'"') => break,
                Some(b'\\') => match self.next() {
                    Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => {}
                    Some(b'u') => {
                        for _ in 0..4 {
                            if !self.next().is_some_and(|b| b.is_ascii_hexdigit()) {
                                return Err(self.syntax("invalid \\u escape"));
                            }
                        }
                    }
                    _ => return Err(self.syntax("invalid escape")),
                },
                Some(0..=0x1f) => return Err(self.syntax("control character in string")),
                Some(_) => {}
            }
        }
        out.extend_from_slice(&self.input[start..self.pos]);
        Ok(())
    }

    /// Copies a number verbatim after checking the RFC 8259 grammar.
    fn number(&mut self, out: &mut Vec<u8>) -> Result<(), JsonTextError> {
        let start = self.pos;
        if self.peek() == Some(b'-') {
            self.pos += 1;
        }
        match self.next() {
            Some(b'0') => {}
            Some(b'1'..=b'9') => self.digits(),
            _ => return Err(self.syntax("invalid number")),
        }
        if self.peek() == Some(b'.') {
            self.pos += 1;
            if !self.peek().is_some_and(|b| b.is_ascii_digit()) {
                return Err(self.syntax("expected a digit after '.'"));
            }
            self.digits();
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.pos += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.pos += 1;
            }
            if !self.peek().is_some_and(|b| b.is_ascii_digit()) {
                return Err(self.syntax("expected a digit in the exponent"));
            }
            self.digits();
        }
        out.extend_from_slice(&self.input[start..self.pos]);
        Ok(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.pos += 1;
        }
    }

    fn literal(&mut self, out: &mut Vec<u8>, word: &'static [u8]) -> Result<(), JsonTextError> {
        if self.input[self.pos..].starts_with(word) {
            self.pos += word.len();
            out.extend_from_slice(word);
            Ok(())
        } else {
            Err(self.syntax("invalid literal"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn one(body: &str) -> Result<String, JsonTextError> {
        let mut m = split_messages(body.as_bytes())?;
        assert_eq!(m.len(), 1);
        Ok(String::from_utf8(m.remove(0)).unwrap())
    }

    #[test]
    fn keeps_text_byte_for_byte_minus_whitespace() {
        assert_eq!(
            one("{ \"b\" : 1, \"a\":2, \"b\" : 1e400 }").unwrap(),
            r#"{"b":1,"a":2,"b":1e400}"#
        );
        assert_eq!(
            one(r#" "a b\n\u00e9\udc00" "#).unwrap(),
            r#""a b\n\u00e9\udc00""#
        );
        assert_eq!(one("-0.50E+03").unwrap(), "-0.50E+03");
    }

    #[test]
    fn splits_one_level_of_array() {
        let m = split_messages(b"[[1, 2], {\"a\": [ ]}, 3]").unwrap();
        assert_eq!(
            m,
            vec![b"[1,2]".to_vec(), b"{\"a\":[]}".to_vec(), b"3".to_vec()]
        );
        assert!(split_messages(b" [ ] ").unwrap().is_empty());
    }

    #[test]
    fn rejects_bad_text() {
        for bad in [
            "",
            "{",
            "[1,]",
            "01",
            "1.",
            "+1",
            "NaN",
            "tru",
            "{\"a\"}",
            "\"\t\"",
            "[1] 2",
            "\"\\x\"",
            "\"\\u12g4\"",
            "{1:2}",
        ] {
            assert!(
                matches!(
                    split_messages(bad.as_bytes()),
                    Err(JsonTextError::Syntax { .. })
                ),
                "{bad:?}"
            );
        }
        assert_eq!(split_messages(b"\"\xff\""), Err(JsonTextError::Utf8));
    }

    #[test]
    fn nesting_limit_is_per_message() {
        let objects = |n: usize| format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n));
        assert!(one(&objects(MAX_NESTING)).is_ok());
        assert_eq!(one(&objects(MAX_NESTING + 1)), Err(JsonTextError::TooDeep));
        // The outer array of a batch is not part of any message.
        let arrays = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert_eq!(
            split_messages(arrays(MAX_NESTING + 1).as_bytes())
                .unwrap()
                .len(),
            1
        );
        assert_eq!(
            split_messages(arrays(MAX_NESTING + 2).as_bytes()),
            Err(JsonTextError::TooDeep)
        );
    }
}
