//! A strict, single-pass JSON scanner over bytes.
//!
//! It validates RFC 8259 JSON (escapes, control characters, number grammar, UTF-8), refuses
//! duplicate object keys at any depth and integer tokens outside the signed 64-bit range, limits
//! nesting, and can copy a value in its compact form: insignificant whitespace removed, member
//! order, number spelling and string escapes kept byte for byte. The ingest decoder uses it for
//! every row and for `object`/`array`/`any` columns, without building a `serde_json::Value`.

use super::number::parse_i64;

/// How deeply a JSON value may nest (objects and arrays), counting the value itself.
pub(crate) const MAX_NESTING: usize = 127;

/// The kind of a JSON value, as named in error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum JsonKind {
    /// `{...}`
    Object,
    /// `[...]`
    Array,
    /// `"..."`
    String,
    /// A number token.
    Number,
    /// `true` or `false`.
    Boolean,
    /// `null`.
    Null,
}

impl JsonKind {
    /// The kind's name with an article, for messages ("found an array").
    pub(crate) fn describe(self) -> &'static str {
        match self {
            JsonKind::Object => "an object",
            JsonKind::Array => "an array",
            JsonKind::String => "a string",
            JsonKind::Number => "a number",
            JsonKind::Boolean => "a boolean",
            JsonKind::Null => "null",
        }
    }

    /// The kind a value starting with byte `b` has, if any.
    pub(crate) fn from_first_byte(b: u8) -> Option<JsonKind> {
        Some(match b {
            b'{' => JsonKind::Object,
            b'[' => JsonKind::Array,
            b'"' => JsonKind::String,
            b'-' | b'0'..=b'9' => JsonKind::Number,
            b't' | b'f' => JsonKind::Boolean,
            b'n' => JsonKind::Null,
            _ => return None,
        })
    }
}

/// What is wrong with a piece of JSON.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum JsonErrorKind {
    /// The input ended inside a value.
    #[error("unexpected end of input")]
    UnexpectedEnd,
    /// A byte that cannot appear here.
    #[error("unexpected {}", describe_byte(*.0))]
    UnexpectedByte(u8),
    /// A backslash escape that JSON does not define, or a bad `\u` escape.
    #[error("invalid escape sequence in string")]
    InvalidEscape,
    /// A raw control character (below U+0020) inside a string.
    #[error("unescaped control character in string")]
    ControlCharacter,
    /// Bytes that are not UTF-8.
    #[error("invalid UTF-8")]
    InvalidUtf8,
    /// A number token that does not follow the JSON grammar.
    #[error("invalid number")]
    InvalidNumber,
    /// The same key twice in one object.
    #[error("duplicate object key {0:?}")]
    DuplicateKey(String),
    /// Nesting deeper than the limit.
    #[error("nested deeper than {0} levels")]
    TooDeep(usize),
    /// An integer token outside the signed 64-bit range inside a structured value.
    #[error("integer {0} inside a JSON value is outside the signed 64-bit range")]
    IntegerOutOfRange(String),
}

fn describe_byte(b: u8) -> String {
    if b.is_ascii_graphic() {
        format!("character '{}'", b as char)
    } else {
        format!("byte 0x{b:02X}")
    }
}

/// A JSON error and the byte offset in the scanned input where it was found.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid JSON: {kind}")]
pub struct JsonError {
    /// What is wrong.
    pub kind: JsonErrorKind,
    /// Byte offset in the input.
    pub offset: usize,
}

/// A string token: its raw content between the quotes, and whether it has escapes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawStr<'a> {
    /// Bytes between the quotes, escapes not decoded.
    pub content: &'a [u8],
    /// Whether `content` has any backslash escape.
    pub escaped: bool,
}

/// A number token and whether it is an integer token (no fraction, no exponent).
#[derive(Debug, Clone, Copy)]
pub(crate) struct NumberToken<'a> {
    /// The token as written.
    pub text: &'a [u8],
    /// No `.`, `e` or `E` in it.
    pub is_integer: bool,
}

/// Where compacted JSON goes: a byte vector, or nowhere when only validating.
pub(crate) trait Sink {
    /// Appends bytes.
    fn put(&mut self, bytes: &[u8]);
    /// Appends one byte.
    fn put_byte(&mut self, byte: u8);
}

impl Sink for Vec<u8> {
    #[inline]
    fn put(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }
    #[inline]
    fn put_byte(&mut self, byte: u8) {
        self.push(byte);
    }
}

/// A sink that drops everything: validation only.
pub(crate) struct Discard;

impl Sink for Discard {
    #[inline]
    fn put(&mut self, _: &[u8]) {}
    #[inline]
    fn put_byte(&mut self, _: u8) {}
}

/// Per-byte class used by the string scanner: 1 for bytes that end the fast path (a quote,
/// a backslash, a control character: the bytes JSON escapes).
static STRING_STOP: [u8; 256] = {
    let mut table = [0u8; 256];
    let mut i = 0;
    while i < 256 {
        if super::cell::ESCAPED_LEN[i] != 1 {
            table[i] = 1;
        }
        i += 1;
    }
    table
};

/// The position of the first byte at or after `i` that is `"`, `\\`, a control character or
/// not ASCII.
#[inline]
fn skip_ascii_string_bytes(input: &[u8], mut i: usize) -> usize {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGHS: u64 = 0x8080_8080_8080_8080;
    while let Some(chunk) = input.get(i..i + 8) {
        let mut word = [0u8; 8];
        word.copy_from_slice(chunk);
        let w = u64::from_le_bytes(word);
        // Per byte: zero after XOR with the quote or backslash, below 0x20, or with the high
        // bit set. The lowest flagged byte is exact (borrows only run towards higher bytes).
        let quote = w ^ (ONES * u64::from(b'"'));
        let backslash = w ^ (ONES * u64::from(b'\\'));
        let flags = (quote.wrapping_sub(ONES) & !quote)
            | (backslash.wrapping_sub(ONES) & !backslash)
            | w.wrapping_sub(ONES * 0x20)
            | w;
        let flags = flags & HIGHS;
        if flags != 0 {
            return i + (flags.trailing_zeros() / 8) as usize;
        }
        i += 8;
    }
    while i < input.len() && STRING_STOP[input[i] as usize] == 0 && input[i] < 0x80 {
        i += 1;
    }
    i
}

/// The position of the first byte at or after `i` that is `"`, `\\` or a control character.
#[inline]
fn skip_string_bytes(input: &[u8], mut i: usize) -> usize {
    while i < input.len() && STRING_STOP[input[i] as usize] == 0 {
        i += 1;
    }
    i
}

/// Byte equality tuned for short keys: keys are mostly under 16 bytes, where a call to
/// `memcmp` costs more than the comparison.
#[inline]
pub(crate) fn short_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let n = a.len();
    let word = |s: &[u8], at: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&s[at..at + 8]);
        u64::from_ne_bytes(w)
    };
    match n {
        0..8 => a.iter().zip(b).all(|(x, y)| x == y),
        // Two overlapping words cover 8..=16 bytes.
        8..=16 => word(a, 0) == word(b, 0) && word(a, n - 8) == word(b, n - 8),
        _ => a == b,
    }
}

/// Objects with at most this many keys check each new key against the earlier ones; larger
/// ones are checked once, sorted, at their end.
const LINEAR_KEY_CHECK: usize = 16;

/// A key of an object being scanned, for the duplicate check.
#[derive(Clone, Copy)]
enum KeyRef {
    /// Unescaped key: a range of the input.
    Input(u32, u32),
    /// Escaped key, decoded into the scratch buffer at this range.
    Scratch(u32, u32),
}

/// The scanner. It holds a position in one input buffer and reusable scratch space.
pub(crate) struct Scanner<'a> {
    input: &'a [u8],
    pos: usize,
    keys: Vec<KeyRef>,
    key_scratch: Vec<u8>,
    max_nesting: usize,
    /// Whether [`Scanner::skip_ws`] has skipped anything since [`Scanner::compact_value`]
    /// began.
    skipped_ws: bool,
}

impl<'a> Scanner<'a> {
    /// A scanner over `input`.
    pub(crate) fn new(input: &'a [u8]) -> Self {
        Scanner {
            input,
            pos: 0,
            keys: Vec::new(),
            key_scratch: Vec::new(),
            max_nesting: MAX_NESTING,
            skipped_ws: false,
        }
    }

    /// The current byte offset.
    #[inline]
    pub(crate) fn pos(&self) -> usize {
        self.pos
    }

    /// The whole input.
    pub(crate) fn input(&self) -> &'a [u8] {
        self.input
    }

    /// Moves to `pos` (used to resynchronise after an error).
    pub(crate) fn set_pos(&mut self, pos: usize) {
        self.pos = pos.min(self.input.len());
    }

    #[inline]
    fn error(&self, kind: JsonErrorKind) -> JsonError {
        JsonError {
            kind,
            offset: self.pos,
        }
    }

    /// The error for whatever is at the current position (a byte that cannot be here, or the
    /// end of the input).
    #[inline]
    pub(crate) fn unexpected(&self) -> JsonError {
        match self.input.get(self.pos) {
            Some(&b) => self.error(JsonErrorKind::UnexpectedByte(b)),
            None => self.error(JsonErrorKind::UnexpectedEnd),
        }
    }

    /// Skips JSON whitespace (space, tab, LF, CR).
    #[inline]
    pub(crate) fn skip_ws(&mut self) {
        while let Some(&b) = self.input.get(self.pos) {
            if b == b' ' || b == b'\n' || b == b'\r' || b == b'\t' {
                self.pos += 1;
                self.skipped_ws = true;
            } else {
                break;
            }
        }
    }

    /// Scans one value (at a non-whitespace byte) and appends its compact form to `out`,
    /// like [`Scanner::value`] with `out` as the sink. Values sent compact already (most are)
    /// are validated without a sink and copied in one piece; only a value with whitespace
    /// in it is scanned again to compact it.
    pub(crate) fn compact_value(
        &mut self,
        out: &mut Vec<u8>,
        depth: usize,
    ) -> Result<JsonKind, JsonError> {
        let start = self.pos;
        self.skipped_ws = false;
        let kind = self.value(&mut Discard, depth)?;
        if self.skipped_ws {
            self.pos = start;
            self.value(out, depth)
        } else {
            out.extend_from_slice(&self.input[start..self.pos]);
            Ok(kind)
        }
    }

    /// The byte at the current position.
    #[inline]
    pub(crate) fn peek(&self) -> Option<u8> {
        self.input.get(self.pos).copied()
    }

    /// Consumes `byte` (after whitespace) or fails.
    #[inline]
    pub(crate) fn expect(&mut self, byte: u8) -> Result<(), JsonError> {
        self.skip_ws();
        if self.peek() == Some(byte) {
            self.pos += 1;
            Ok(())
        } else {
            Err(self.unexpected())
        }
    }

    /// Scans a string token at the current position (which must be `"`).
    #[inline]
    pub(crate) fn string(&mut self) -> Result<RawStr<'a>, JsonError> {
        debug_assert_eq!(self.peek(), Some(b'"'));
        self.pos += 1;
        let start = self.pos;
        let input = self.input;
        let mut escaped = false;
        let mut non_ascii = false;
        let mut i = start;
        loop {
            // Fast path: skip bytes that cannot end the string or start an escape. Until the
            // first non-ASCII byte, eight at a time; after it, by table.
            i = if non_ascii {
                skip_string_bytes(input, i)
            } else {
                skip_ascii_string_bytes(input, i)
            };
            match input.get(i) {
                Some(b'"') => break,
                Some(b'\\') => {
                    escaped = true;
                    i = self.check_escape(i)?;
                }
                Some(&b) if b >= 0x80 => {
                    non_ascii = true;
                    i += 1;
                }
                Some(_) => {
                    self.pos = i;
                    return Err(self.error(JsonErrorKind::ControlCharacter));
                }
                None => {
                    self.pos = i;
                    return Err(self.error(JsonErrorKind::UnexpectedEnd));
                }
            }
        }
        // Only strings can hold non-ASCII bytes (anywhere else they are a syntax error), so
        // checking these strings is checking the input.
        if non_ascii && std::str::from_utf8(&input[start..i]).is_err() {
            self.pos = start;
            return Err(self.error(JsonErrorKind::InvalidUtf8));
        }
        self.pos = i + 1;
        Ok(RawStr {
            content: &input[start..i],
            escaped,
        })
    }

    /// Checks the escape at `i` (a backslash); returns the position after it.
    fn check_escape(&mut self, i: usize) -> Result<usize, JsonError> {
        let input = self.input;
        match input.get(i + 1) {
            Some(b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't') => Ok(i + 2),
            Some(b'u') => {
                let hex = input.get(i + 2..i + 6);
                match hex {
                    Some(h) if h.iter().all(u8::is_ascii_hexdigit) => Ok(i + 6),
                    _ => {
                        self.pos = i;
                        Err(self.error(JsonErrorKind::InvalidEscape))
                    }
                }
            }
            _ => {
                self.pos = i;
                Err(self.error(JsonErrorKind::InvalidEscape))
            }
        }
    }

    /// Scans a number token at the current position.
    #[inline]
    pub(crate) fn number(&mut self) -> Result<NumberToken<'a>, JsonError> {
        let input = self.input;
        let start = self.pos;
        let mut i = start;
        let digit = |i: usize| input.get(i).is_some_and(u8::is_ascii_digit);
        if input.get(i) == Some(&b'-') {
            i += 1;
        }
        match input.get(i) {
            Some(b'0') => i += 1,
            Some(b'1'..=b'9') => {
                i += 1;
                while digit(i) {
                    i += 1;
                }
            }
            _ => {
                self.pos = i;
                return Err(self.error(JsonErrorKind::InvalidNumber));
            }
        }
        let mut is_integer = true;
        if input.get(i) == Some(&b'.') {
            i += 1;
            if !digit(i) {
                self.pos = i;
                return Err(self.error(JsonErrorKind::InvalidNumber));
            }
            while digit(i) {
                i += 1;
            }
            is_integer = false;
        }
        if matches!(input.get(i), Some(b'e' | b'E')) {
            i += 1;
            if matches!(input.get(i), Some(b'+' | b'-')) {
                i += 1;
            }
            if !digit(i) {
                self.pos = i;
                return Err(self.error(JsonErrorKind::InvalidNumber));
            }
            while digit(i) {
                i += 1;
            }
            is_integer = false;
        }
        // A number directly followed by a digit-like byte ("01") is malformed.
        if digit(i) {
            self.pos = i;
            return Err(self.error(JsonErrorKind::InvalidNumber));
        }
        self.pos = i;
        Ok(NumberToken {
            text: &input[start..i],
            is_integer,
        })
    }

    /// Consumes the literal `true`, `false` or `null` at the current position.
    #[inline]
    pub(crate) fn literal(&mut self) -> Result<&'static [u8], JsonError> {
        let rest = &self.input[self.pos.min(self.input.len())..];
        for word in [&b"true"[..], b"false", b"null"] {
            if rest.starts_with(word) {
                self.pos += word.len();
                return Ok(word);
            }
        }
        Err(self.unexpected())
    }

    /// Scans one value (after whitespace), writing its compact form to `sink`, and returns its
    /// kind. `depth` is the nesting of the value's container (0 at the top).
    pub(crate) fn value<S: Sink>(
        &mut self,
        sink: &mut S,
        depth: usize,
    ) -> Result<JsonKind, JsonError> {
        self.skip_ws();
        let Some(b) = self.peek() else {
            return Err(self.error(JsonErrorKind::UnexpectedEnd));
        };
        match b {
            b'"' => {
                let s = self.string()?;
                sink.put_byte(b'"');
                sink.put(s.content);
                sink.put_byte(b'"');
                Ok(JsonKind::String)
            }
            b'-' | b'0'..=b'9' => {
                let start = self.pos;
                let n = self.number()?;
                if n.is_integer && parse_i64(n.text).is_none() {
                    self.pos = start;
                    return Err(self.error(JsonErrorKind::IntegerOutOfRange(
                        String::from_utf8_lossy(n.text).into_owned(),
                    )));
                }
                sink.put(n.text);
                Ok(JsonKind::Number)
            }
            b't' | b'f' | b'n' => {
                let word = self.literal()?;
                sink.put(word);
                Ok(if b == b'n' {
                    JsonKind::Null
                } else {
                    JsonKind::Boolean
                })
            }
            b'[' => {
                self.enter(depth)?;
                self.pos += 1;
                sink.put_byte(b'[');
                self.skip_ws();
                if self.peek() == Some(b']') {
                    self.pos += 1;
                } else {
                    loop {
                        self.value(sink, depth + 1)?;
                        self.skip_ws();
                        match self.peek() {
                            Some(b',') => {
                                self.pos += 1;
                                sink.put_byte(b',');
                            }
                            Some(b']') => {
                                self.pos += 1;
                                break;
                            }
                            _ => return Err(self.unexpected()),
                        }
                    }
                }
                sink.put_byte(b']');
                Ok(JsonKind::Array)
            }
            b'{' => {
                self.enter(depth)?;
                self.pos += 1;
                sink.put_byte(b'{');
                self.object_members(sink, depth)?;
                sink.put_byte(b'}');
                Ok(JsonKind::Object)
            }
            _ => Err(self.unexpected()),
        }
    }

    fn enter(&self, depth: usize) -> Result<(), JsonError> {
        if depth >= self.max_nesting {
            Err(self.error(JsonErrorKind::TooDeep(self.max_nesting)))
        } else {
            Ok(())
        }
    }

    /// Scans members after `{` through the closing `}`, checking for duplicate keys.
    fn object_members<S: Sink>(&mut self, sink: &mut S, depth: usize) -> Result<(), JsonError> {
        let frame = self.keys.len();
        let scratch_frame = self.key_scratch.len();
        let result = self.object_members_inner(sink, depth, frame);
        self.keys.truncate(frame);
        self.key_scratch.truncate(scratch_frame);
        result
    }

    fn object_members_inner<S: Sink>(
        &mut self,
        sink: &mut S,
        depth: usize,
        frame: usize,
    ) -> Result<(), JsonError> {
        self.skip_ws();
        if self.peek() == Some(b'}') {
            self.pos += 1;
            return Ok(());
        }
        loop {
            self.skip_ws();
            if self.peek() != Some(b'"') {
                return Err(self.unexpected());
            }
            let key_pos = self.pos;
            let key = self.string()?;
            self.push_key(key);
            if self.keys.len() - frame <= LINEAR_KEY_CHECK
                && let Some(duplicate) = self.duplicate_of_last(frame)
            {
                self.pos = key_pos;
                return Err(self.error(JsonErrorKind::DuplicateKey(duplicate)));
            }
            sink.put_byte(b'"');
            sink.put(key.content);
            sink.put(b"\":");
            self.expect(b':')?;
            self.value(sink, depth + 1)?;
            self.skip_ws();
            match self.peek() {
                Some(b',') => {
                    self.pos += 1;
                    sink.put_byte(b',');
                }
                Some(b'}') => {
                    if self.keys.len() - frame > LINEAR_KEY_CHECK
                        && let Some(duplicate) = self.duplicate_in_frame(frame)
                    {
                        return Err(self.error(JsonErrorKind::DuplicateKey(duplicate)));
                    }
                    self.pos += 1;
                    return Ok(());
                }
                _ => return Err(self.unexpected()),
            }
        }
    }

    fn push_key(&mut self, key: RawStr<'a>) {
        let key_ref = if key.escaped {
            let start = self.key_scratch.len();
            unescape_into(key.content, &mut self.key_scratch, true).ok();
            KeyRef::Scratch(start as u32, self.key_scratch.len() as u32)
        } else {
            let start = key.content.as_ptr() as usize - self.input.as_ptr() as usize;
            KeyRef::Input(start as u32, (start + key.content.len()) as u32)
        };
        self.keys.push(key_ref);
    }

    fn key_bytes(&self, key: KeyRef) -> &[u8] {
        match key {
            KeyRef::Input(s, e) => &self.input[s as usize..e as usize],
            KeyRef::Scratch(s, e) => &self.key_scratch[s as usize..e as usize],
        }
    }

    /// Any key that repeats in a large object, found by sorting (O(n log n) where checking
    /// each new key against all earlier ones would be quadratic).
    fn duplicate_in_frame(&self, frame: usize) -> Option<String> {
        let mut keys: Vec<&[u8]> = self.keys[frame..]
            .iter()
            .map(|k| self.key_bytes(*k))
            .collect();
        keys.sort_unstable();
        keys.windows(2)
            .find(|w| w[0] == w[1])
            .map(|w| String::from_utf8_lossy(w[0]).into_owned())
    }

    /// Whether the last pushed key repeats an earlier key of the same object.
    fn duplicate_of_last(&self, frame: usize) -> Option<String> {
        let (last, earlier) = self.keys[frame..].split_last()?;
        let last_bytes = self.key_bytes(*last);
        earlier
            .iter()
            .any(|k| short_eq(self.key_bytes(*k), last_bytes))
            .then(|| String::from_utf8_lossy(last_bytes).into_owned())
    }
}

/// Decodes the escapes of a string token's content, appending UTF-8 to `out`.
///
/// A lone surrogate escape is written as its 3-byte generalized-UTF-8 form when
/// `allow_lone_surrogates` is set (for key comparison only), and is an error carrying the code
/// unit otherwise. The content must have passed [`Scanner::string`].
pub(crate) fn unescape_into(
    content: &[u8],
    out: &mut Vec<u8>,
    allow_lone_surrogates: bool,
) -> Result<(), u16> {
    let mut i = 0;
    while i < content.len() {
        let b = content[i];
        if b != b'\\' {
            let run_end = content[i..]
                .iter()
                .position(|&c| c == b'\\')
                .map_or(content.len(), |p| i + p);
            out.extend_from_slice(&content[i..run_end]);
            i = run_end;
            continue;
        }
        let escape = content.get(i + 1).copied().unwrap_or(b'\\');
        i += 2;
        let byte = match escape {
            b'"' => b'"',
            b'\\' => b'\\',
            b'/' => b'/',
            b'b' => 0x08,
            b'f' => 0x0C,
            b'n' => b'\n',
            b'r' => b'\r',
            b't' => b'\t',
            _ => {
                let unit = hex4(content, i);
                i += 4;
                let code = if (0xD800..0xDC00).contains(&unit) {
                    // A high surrogate: a low one must follow as another \u escape.
                    let low = (content.get(i) == Some(&b'\\') && content.get(i + 1) == Some(&b'u'))
                        .then(|| hex4(content, i + 2))
                        .filter(|low| (0xDC00..0xE000).contains(low));
                    match low {
                        Some(low) => {
                            i += 6;
                            0x10000 + ((u32::from(unit) - 0xD800) << 10) + (u32::from(low) - 0xDC00)
                        }
                        None if allow_lone_surrogates => u32::from(unit),
                        None => return Err(unit),
                    }
                } else if (0xDC00..0xE000).contains(&unit) {
                    if !allow_lone_surrogates {
                        return Err(unit);
                    }
                    u32::from(unit)
                } else {
                    u32::from(unit)
                };
                push_code_point(out, code);
                continue;
            }
        };
        out.push(byte);
    }
    Ok(())
}

fn hex4(content: &[u8], at: usize) -> u16 {
    let mut value = 0u16;
    for &h in content.get(at..at + 4).unwrap_or(b"0000") {
        let digit = match h {
            b'0'..=b'9' => h - b'0',
            b'a'..=b'f' => h - b'a' + 10,
            b'A'..=b'F' => h - b'A' + 10,
            _ => 0,
        };
        value = value << 4 | u16::from(digit);
    }
    value
}

/// Appends a code point (or a lone surrogate, as generalized UTF-8) to `out`.
fn push_code_point(out: &mut Vec<u8>, code: u32) {
    if code < 0x80 {
        out.push(code as u8);
    } else if code < 0x800 {
        out.extend_from_slice(&[0xC0 | (code >> 6) as u8, 0x80 | (code & 0x3F) as u8]);
    } else if code < 0x10000 {
        out.extend_from_slice(&[
            0xE0 | (code >> 12) as u8,
            0x80 | ((code >> 6) & 0x3F) as u8,
            0x80 | (code & 0x3F) as u8,
        ]);
    } else {
        out.extend_from_slice(&[
            0xF0 | (code >> 18) as u8,
            0x80 | ((code >> 12) & 0x3F) as u8,
            0x80 | ((code >> 6) & 0x3F) as u8,
            0x80 | (code & 0x3F) as u8,
        ]);
    }
}

/// Validates one complete JSON document and returns its compact form.
///
/// ```
/// use sluice::types::json::compact;
/// assert_eq!(compact(br#" { "a" : [1, 2.50, "x\u0041"] } "#).unwrap(), br#"{"a":[1,2.50,"x\u0041"]}"#);
/// assert!(compact(br#"{"a":1,"a":2}"#).is_err());
/// ```
pub fn compact(input: &[u8]) -> Result<Vec<u8>, JsonError> {
    let mut scanner = Scanner::new(input);
    let mut out = Vec::with_capacity(input.len());
    scanner.value(&mut out, 0)?;
    scanner.skip_ws();
    if scanner.pos() != input.len() {
        return Err(scanner.unexpected());
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err_kind(input: &[u8]) -> JsonErrorKind {
        compact(input).unwrap_err().kind
    }

    #[test]
    fn accepts_and_compacts() {
        assert_eq!(compact(b"[ ]").unwrap(), b"[]");
        assert_eq!(compact(b"{ }").unwrap(), b"{}");
        assert_eq!(compact(b"\t-0.0e+5\r\n").unwrap(), b"-0.0e+5");
        assert_eq!(compact(br#""\ud800""#).unwrap(), br#""\ud800""#);
        assert_eq!(compact("\"é\"".as_bytes()).unwrap(), "\"é\"".as_bytes());
    }

    /// Compact values are copied as they are; values with whitespace anywhere inside are
    /// compacted; what follows the value is left for the caller; errors append nothing.
    #[test]
    fn compact_value_copies_or_compacts() {
        let cases: [(&[u8], &[u8]); 4] = [
            (
                br#"{"a":[1,{"b":"c d"}],"e":null}, next"#,
                br#"{"a":[1,{"b":"c d"}],"e":null}"#,
            ),
            (
                br#"{"a": [1, {"b" :"c d"}] ,"e":null}, next"#,
                br#"{"a":[1,{"b":"c d"}],"e":null}"#,
            ),
            (b"[1,2 ]}", b"[1,2]"),
            (br#""\u00e9 x""#, br#""\u00e9 x""#),
        ];
        for (input, expected) in cases {
            let mut scanner = Scanner::new(input);
            let mut out = b"prefix:".to_vec();
            scanner.compact_value(&mut out, 0).unwrap();
            assert_eq!(&out[7..], expected, "{}", String::from_utf8_lossy(input));
            assert!(matches!(input.get(scanner.pos()), None | Some(b',' | b'}')));
        }
        let mut scanner = Scanner::new(br#"{"a":1, "a":2}"#);
        let mut out = Vec::new();
        assert!(scanner.compact_value(&mut out, 0).is_err());
        assert!(out.is_empty());
    }

    #[test]
    fn rejects() {
        assert_eq!(err_kind(b"01"), JsonErrorKind::InvalidNumber);
        assert_eq!(err_kind(b"1."), JsonErrorKind::InvalidNumber);
        assert_eq!(err_kind(b"+1"), JsonErrorKind::UnexpectedByte(b'+'));
        assert_eq!(err_kind(b"[1,]"), JsonErrorKind::UnexpectedByte(b']'));
        assert_eq!(err_kind(b"\"a\x01\""), JsonErrorKind::ControlCharacter);
        assert_eq!(err_kind(b"\"\\x\""), JsonErrorKind::InvalidEscape);
        assert_eq!(err_kind(b"\"\xff\""), JsonErrorKind::InvalidUtf8);
        assert_eq!(err_kind(b"\"abc"), JsonErrorKind::UnexpectedEnd);
        assert_eq!(
            err_kind(br#"{"a":1,"\u0061":2}"#),
            JsonErrorKind::DuplicateKey("a".into())
        );
        assert_eq!(
            err_kind(br#"[{"x":{"a":1,"a":2}}]"#),
            JsonErrorKind::DuplicateKey("a".into())
        );
        assert_eq!(
            err_kind(b"[9223372036854775808]"),
            JsonErrorKind::IntegerOutOfRange("9223372036854775808".into())
        );
        assert!(compact(b"[-9223372036854775808, 1e999]").is_ok());
        let deep_ok = format!("{}{}", "[".repeat(127), "]".repeat(127));
        assert!(compact(deep_ok.as_bytes()).is_ok());
        let mut wide = String::from("{");
        for i in 0..1000 {
            wide.push_str(&format!("\"k{i}\":{i},"));
        }
        assert!(compact(format!("{wide}\"end\":0}}").as_bytes()).is_ok());
        assert_eq!(
            err_kind(format!("{wide}\"k500\":0}}").as_bytes()),
            JsonErrorKind::DuplicateKey("k500".into())
        );
        let too_deep = format!("{}{}", "[".repeat(128), "]".repeat(128));
        assert_eq!(err_kind(too_deep.as_bytes()), JsonErrorKind::TooDeep(127));
    }

    #[test]
    fn unescapes() {
        let mut out = Vec::new();
        unescape_into(br#"a\n\u00e9\ud83d\ude00\/"#, &mut out, false).unwrap();
        assert_eq!(out, "a\né😀/".as_bytes());
        assert_eq!(
            unescape_into(br#"\udc00"#, &mut Vec::new(), false),
            Err(0xDC00)
        );
        assert_eq!(
            unescape_into(br#"\ud800x"#, &mut Vec::new(), false),
            Err(0xD800)
        );
    }
}
