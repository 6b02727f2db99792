//! Which streams a subscription watches: stream names it may list, and patterns.
//!
//! A pattern is literal text with `*` (any run of characters within one path segment) and
//! `**` (any run, `/` included). Matching is iterative: the set of name positions reachable
//! after each part of the pattern, so it costs (parts × name length) whatever the pattern,
//! with no backtracking; a pattern's literal head and tail reject most names before that.

/// Longest stream name a subscription may list or match, in bytes.
pub(crate) const MAX_NAME_BYTES: usize = 1024;

/// Whether a linked name could be a stream's (the protocol layout's rules): 1 to
/// [`MAX_NAME_BYTES`] bytes, no control characters, no empty, `.` or `..` segment.
pub(crate) fn valid_stream_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_NAME_BYTES
        && !name.bytes().any(|b| b < 0x20 || b == 0x7f)
        && name
            .split('/')
            .all(|seg| !seg.is_empty() && seg != "." && seg != "..")
}

/// A pattern part: literal text (a range of the pattern), `*` or `**`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Text(usize, usize),
    Star,
    DoubleStar,
}

/// A compiled pattern.
#[derive(Debug, Clone)]
pub(crate) struct Pattern {
    text: String,
    parts: Vec<Part>,
}

/// Why a pattern was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum PatternError {
    /// Longer than allowed.
    TooLong { limit: usize },
    /// More wildcards than allowed.
    TooManyWildcards { found: usize, limit: usize },
}

impl std::fmt::Display for PatternError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            PatternError::TooLong { limit } => write!(f, "pattern is longer than {limit} bytes"),
            PatternError::TooManyWildcards { found, limit } => write!(
                f,
                "pattern has {found} wildcards; at most {limit} are allowed"
            ),
        }
    }
}

impl Pattern {
    /// Compiles `text`, refusing patterns over `max_bytes` or with more than `max_wildcards`
    /// wildcards (`None`: a stored pattern, accepted under the limits of its time).
    pub(crate) fn parse(
        text: &str,
        limits: Option<(usize, usize)>,
    ) -> Result<Pattern, PatternError> {
        if let Some((max_bytes, _)) = limits
            && text.len() > max_bytes
        {
            return Err(PatternError::TooLong { limit: max_bytes });
        }
        let p = text.as_bytes();
        let mut parts = Vec::new();
        let mut i = 0;
        while i < p.len() {
            if p[i] == b'*' {
                if p.get(i + 1) == Some(&b'*') {
                    parts.push(Part::DoubleStar);
                    i += 2;
                } else {
                    parts.push(Part::Star);
                    i += 1;
                }
            } else {
                let end = p[i..]
                    .iter()
                    .position(|b| *b == b'*')
                    .map_or(p.len(), |e| i + e);
                parts.push(Part::Text(i, end));
                i = end;
            }
        }
        let wildcards = parts
            .iter()
            .filter(|p| !matches!(p, Part::Text(..)))
            .count();
        if let Some((_, max_wildcards)) = limits
            && wildcards > max_wildcards
        {
            return Err(PatternError::TooManyWildcards {
                found: wildcards,
                limit: max_wildcards,
            });
        }
        Ok(Pattern {
            text: text.to_owned(),
            parts,
        })
    }

    /// The literal text before the first wildcard: every name the pattern matches starts
    /// with it.
    pub(crate) fn head(&self) -> &str {
        match self.parts.first() {
            Some(Part::Text(start, end)) => &self.text[*start..*end],
            _ => "",
        }
    }

    fn text_of(&self, part: Part) -> &[u8] {
        match part {
            Part::Text(start, end) => &self.text.as_bytes()[start..end],
            _ => b"",
        }
    }

    /// Whether `name` matches.
    pub(crate) fn matches(&self, name: &str) -> bool {
        let s = name.as_bytes();
        // The literal head and tail first: most names fail there.
        if let Some(first @ Part::Text(..)) = self.parts.first().copied()
            && !s.starts_with(self.text_of(first))
        {
            return false;
        }
        if let Some(last @ Part::Text(..)) = self.parts.last().copied()
            && !s.ends_with(self.text_of(last))
        {
            return false;
        }
        let mut reach = vec![false; s.len() + 1];
        let mut next = vec![false; s.len() + 1];
        reach[0] = true;
        for part in &self.parts {
            next.iter_mut().for_each(|n| *n = false);
            match *part {
                Part::Text(..) => {
                    let t = self.text_of(*part);
                    for i in (0..=s.len()).filter(|i| reach[*i]) {
                        if s[i..].starts_with(t) {
                            next[i + t.len()] = true;
                        }
                    }
                }
                Part::Star => {
                    // From each reachable position, on to the end of its segment.
                    let mut open = false;
                    for i in 0..=s.len() {
                        open |= reach[i];
                        next[i] = open;
                        if i < s.len() && s[i] == b'/' {
                            open = false;
                        }
                    }
                }
                Part::DoubleStar => {
                    if let Some(first) = reach.iter().position(|r| *r) {
                        next[first..].iter_mut().for_each(|n| *n = true);
                    }
                }
            }
            std::mem::swap(&mut reach, &mut next);
            if !reach.iter().any(|r| *r) {
                return false;
            }
        }
        reach[s.len()]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn glob(pattern: &str, name: &str) -> bool {
        Pattern::parse(pattern, None).unwrap().matches(name)
    }

    #[test]
    fn globs() {
        assert!(glob("events/*", "events/a"));
        assert!(!glob("events/*", "events/a/b"));
        assert!(glob("events/**", "events/a/b"));
        assert!(!glob("events/*", "other/a"));
        assert!(glob("", ""));
        assert!(!glob("", "a"));
        assert!(glob("a*", "a"));
        assert!(glob("*a", "ba"));
        assert!(!glob("*a", "ab"));
        assert_eq!(
            Pattern::parse("events/*/x", None).unwrap().head(),
            "events/"
        );
        assert_eq!(Pattern::parse("**", None).unwrap().head(), "");
        assert_eq!(Pattern::parse("plain", None).unwrap().head(), "plain");
    }

    #[test]
    fn globs_are_linear_and_bounded() {
        assert!(glob("**", "a/b/c"));
        assert!(glob("a/*/c", "a/b/c"));
        assert!(!glob("a/*/c", "a/b/x/c"));
        assert!(glob("a/**/c", "a/b/x/c"));
        assert!(glob("*a*b*", "xaybz"));
        assert!(!glob("*a*b*", "xbyaz"));
        // Many stars against a long name that almost matches: linear, answered at once.
        let name = format!("{}/", "a".repeat(10_000));
        assert!(!glob(&format!("{}b", "*a".repeat(1000)), &name));
        let limits = Some((256, 8));
        assert!(Pattern::parse(&"*".repeat(64), limits).is_err());
        assert!(Pattern::parse(&"a".repeat(1000), limits).is_err());
        assert!(Pattern::parse("events/**", limits).is_ok());
    }

    #[test]
    fn stream_names() {
        assert!(valid_stream_name("a/b"));
        assert!(!valid_stream_name(""));
        assert!(!valid_stream_name("a//b"));
        assert!(!valid_stream_name("a/../b"));
        assert!(!valid_stream_name("a\nb"));
        assert!(!valid_stream_name(&"a".repeat(MAX_NAME_BYTES + 1)));
    }
}
