//! Lexing shared by the catalog-statement and ScopeQL tokenizers: comments and quoted text.

/// If a `--` or `/* */` comment starts at byte `i`, the position after it. `Err` for a block
/// comment that never ends.
pub(super) fn skip_comment(src: &str, i: usize) -> Result<Option<usize>, &'static str> {
    let rest = &src[i..];
    if rest.starts_with("--") {
        Ok(Some(rest.find('\n').map_or(src.len(), |p| i + p)))
    } else if let Some(body) = rest.strip_prefix("/*") {
        body.find("*/")
            .map(|p| Some(i + 2 + p + 2))
            .ok_or("unterminated comment")
    } else {
        Ok(None)
    }
}

/// Reads the quoted text whose opening quote is at byte `start`; returns the text and the
/// position after the closing quote. A doubled quote stands for itself; with
/// `backslash_escapes`, `\n`, `\t`, `\r` are control characters and `\x` stands for `x`.
pub(super) fn read_quoted(
    src: &str,
    start: usize,
    backslash_escapes: bool,
) -> Result<(String, usize), &'static str> {
    let bytes = src.as_bytes();
    let quote = bytes[start];
    let mut text = String::new();
    let mut i = start + 1;
    loop {
        let Some(ch) = src[i..].chars().next() else {
            return Err("unterminated quoted text");
        };
        i += ch.len_utf8();
        if ch as u32 == u32::from(quote) {
            if bytes.get(i) == Some(&quote) {
                text.push(ch);
                i += 1;
                continue;
            }
            return Ok((text, i));
        }
        if ch == '\\' && backslash_escapes {
            let Some(next) = src[i..].chars().next() else {
                return Err("unterminated quoted text");
            };
            i += next.len_utf8();
            text.push(match next {
                'n' => '\n',
                't' => '\t',
                'r' => '\r',
                other => other,
            });
            continue;
        }
        text.push(ch);
    }
}

/// The first word of a statement, after whitespace and comments (empty if there is none).
pub(super) fn first_word(src: &str) -> &str {
    let mut i = 0;
    loop {
        let rest = &src[i..];
        let trimmed = rest.trim_start();
        i += rest.len() - trimmed.len();
        match skip_comment(src, i) {
            Ok(Some(next)) => i = next,
            Ok(None) => break,
            Err(_) => return "",
        }
    }
    let rest = &src[i..];
    let end = rest
        .find(|c: char| !c.is_ascii_alphanumeric() && c != '_')
        .unwrap_or(rest.len());
    &rest[..end]
}
