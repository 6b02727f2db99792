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

/// How a statement's text may be read: the parsers differ in whether block comments nest
/// (DataFusion's does, sluice's own do not) and whether a backslash escapes a quote (ScopeQL
/// strings: yes; SQL: no). [`expression_depth`] reads the text each way and keeps the
/// deepest, so no parser can see deeper nesting than it measured.
#[derive(Debug, Clone, Copy)]
struct Reading {
    nested_comments: bool,
    backslash_escapes: bool,
}

/// Words that join or wrap expressions without an operator character (`a AND b`, `NOT x`,
/// `x IS NULL`, `x AT TIME ZONE z`, …): each can add a level to an expression tree.
const EXPRESSION_WORDS: &[&str] = &[
    "AND", "OR", "NOT", "IS", "IN", "LIKE", "ILIKE", "RLIKE", "REGEXP", "SIMILAR", "BETWEEN", "AT",
    "COLLATE", "ESCAPE", "OVERLAPS", "DIV", "MOD", "XOR", "ISNULL", "NOTNULL", "EXISTS", "ANY",
    "ALL", "SOME", "INTERVAL",
];

/// Words that chain whole queries or clauses (`a UNION b UNION c`, a join per `JOIN`, a
/// ScopeQL clause per `WHERE`, `SELECT`, …): each can add a level to the query's tree even
/// across commas (`SELECT 1, 2 UNION ALL SELECT 1, 2 …`), so they are counted for their whole
/// bracket, never reset by a `,`.
const CHAIN_WORDS: &[&str] = &[
    "UNION",
    "INTERSECT",
    "EXCEPT",
    "SELECT",
    "WHERE",
    "GROUP",
    "AGGREGATE",
    "DISTINCT",
    "ORDER",
    "LIMIT",
    "OFFSET",
    "JOIN",
    "INSERT",
    "FROM",
    "HAVING",
    "QUALIFY",
    "WINDOW",
];

/// An upper bound on how deep the expressions (and subqueries) of a statement can nest
/// once parsed, found without parsing: brackets and `CASE … END` open a level, and every
/// operator character and joining word counts one more level in its bracket (`1+1+1` is a
/// tree three deep), until a `,` or `;` starts a sibling. It counts too much rather than too
/// little: the real tree is usually much shallower. Linear in the text, with no recursion.
pub(crate) fn expression_depth(src: &str) -> usize {
    let mut deepest = 0;
    for nested_comments in [false, true] {
        for backslash_escapes in [false, true] {
            let reading = Reading {
                nested_comments,
                backslash_escapes,
            };
            deepest = deepest.max(depth_in(src, reading));
        }
    }
    deepest
}

fn depth_in(src: &str, reading: Reading) -> usize {
    let bytes = src.as_bytes();
    // Per open bracket: operators since the last `,` (reset by it) and chaining words (never
    // reset). Their sum over the open brackets, plus the brackets, is the depth.
    let mut levels: Vec<(usize, usize)> = vec![(0, 0)];
    let mut sum = 0usize;
    let mut deepest = 0usize;
    let mut i = 0;
    let add = |levels: &mut Vec<(usize, usize)>, sum: &mut usize, chain: bool| {
        if let Some(top) = levels.last_mut() {
            if chain {
                top.1 += 1;
            } else {
                top.0 += 1;
            }
            *sum += 1;
        }
    };
    let close = |levels: &mut Vec<(usize, usize)>, sum: &mut usize| {
        if levels.len() > 1
            && let Some((ops, chain)) = levels.pop()
        {
            *sum -= ops + chain;
        }
    };
    while i < bytes.len() {
        let c = bytes[i];
        match c {
            b'\'' | b'"' | b'`' => {
                i = skip_quoted(bytes, i, reading.backslash_escapes);
                continue;
            }
            b'-' if bytes.get(i + 1) == Some(&b'-') => {
                i = bytes[i..]
                    .iter()
                    .position(|b| *b == b'\n')
                    .map_or(bytes.len(), |p| i + p);
                continue;
            }
            b'/' if bytes.get(i + 1) == Some(&b'*') => {
                i = skip_block_comment(bytes, i, reading.nested_comments);
                continue;
            }
            b'(' | b'[' => {
                if c == b'[' {
                    // `v['a']['b']` wraps `v` once per index.
                    add(&mut levels, &mut sum, false);
                }
                levels.push((0, 0));
            }
            b')' | b']' => close(&mut levels, &mut sum),
            b',' | b';' => {
                if let Some(top) = levels.last_mut() {
                    sum -= top.0;
                    top.0 = 0;
                }
            }
            b'+' | b'-' | b'*' | b'/' | b'%' | b'<' | b'>' | b'=' | b'!' | b'|' | b'&' | b'^'
            | b'~' | b':' | b'@' | b'#' | b'?' => add(&mut levels, &mut sum, false),
            c if c.is_ascii_alphabetic() || c == b'_' => {
                let start = i;
                while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                    i += 1;
                }
                let word = &src[start..i];
                let is = |words: &[&str]| words.iter().any(|w| word.eq_ignore_ascii_case(w));
                if word.eq_ignore_ascii_case("CASE") {
                    levels.push((0, 0));
                } else if word.eq_ignore_ascii_case("END") {
                    close(&mut levels, &mut sum);
                } else if is(CHAIN_WORDS) {
                    add(&mut levels, &mut sum, true);
                } else if is(EXPRESSION_WORDS) {
                    add(&mut levels, &mut sum, false);
                }
                deepest = deepest.max(levels.len() - 1 + sum);
                continue;
            }
            _ => {}
        }
        deepest = deepest.max(levels.len() - 1 + sum);
        i += 1;
    }
    deepest
}

/// The position after the quoted text starting at `start` (the end of input if it never
/// closes). A doubled quote stands for itself.
fn skip_quoted(bytes: &[u8], start: usize, backslash_escapes: bool) -> usize {
    let quote = bytes[start];
    let mut i = start + 1;
    while i < bytes.len() {
        let c = bytes[i];
        if backslash_escapes && c == b'\\' {
            i += 2;
            continue;
        }
        if c == quote {
            if bytes.get(i + 1) == Some(&quote) {
                i += 2;
                continue;
            }
            return i + 1;
        }
        i += 1;
    }
    bytes.len()
}

/// The position after the block comment starting at `start` (`/*`).
fn skip_block_comment(bytes: &[u8], start: usize, nested: bool) -> usize {
    let mut depth = 0usize;
    let mut i = start;
    while i + 1 < bytes.len() {
        if bytes[i] == b'/' && bytes[i + 1] == b'*' {
            if depth > 0 && !nested {
                i += 1;
                continue;
            }
            depth += 1;
            i += 2;
        } else if bytes[i] == b'*' && bytes[i + 1] == b'/' {
            depth -= 1;
            i += 2;
            if depth == 0 {
                return i;
            }
        } else {
            i += 1;
        }
    }
    bytes.len()
}

#[cfg(test)]
mod depth_tests {
    use super::expression_depth;

    #[test]
    fn depth_counts_brackets_operators_and_joining_words() {
        assert_eq!(expression_depth("SELECT 1"), 1);
        assert_eq!(expression_depth("SELECT 1+1+1"), 3);
        assert_eq!(expression_depth("SELECT f(1+1, 2+2)"), 3);
        assert_eq!(expression_depth("SELECT ((1))"), 3);
        // Set operations and clauses chain across commas.
        let unions = format!("SELECT 1, 2{}", " UNION ALL SELECT 1, 2".repeat(300));
        assert!(expression_depth(&unions) >= 600);
        assert!(expression_depth(&"VALUES (true) WHERE column1 ".repeat(300)) >= 300);
        assert!(expression_depth("SELECT a = 1 OR a = 2 OR a = 3") >= 5);
        assert_eq!(expression_depth("SELECT '(((((' , \"((\" -- (((\n"), 1);
        assert!(expression_depth(&format!("SELECT {}", "NOT ".repeat(100))) >= 100);
        assert!(expression_depth(&"CASE WHEN x THEN ".repeat(50)) >= 50);
        assert!(expression_depth(&"v['a']".repeat(100)) >= 100);
    }

    #[test]
    fn quotes_and_comments_cannot_hide_operators_from_every_reading() {
        // A backslash ends this string for SQL, not for ScopeQL: either way, it is counted.
        let hidden = format!("SELECT 'a\\' || {} || '", vec!["1"; 200].join("+"));
        assert!(expression_depth(&hidden) >= 200);
        // Nested for DataFusion, not for sluice's lexers.
        let comment = format!("/* /* */ {} */ SELECT 1", vec!["1"; 200].join("+"));
        assert!(expression_depth(&comment) >= 200);
        let line = format!("SELECT 1 -- {}", vec!["1"; 200].join("+"));
        assert_eq!(expression_depth(&line), 1);
    }
}
