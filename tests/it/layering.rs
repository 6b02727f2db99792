//! The crate's top-level modules form no import cycle (the layering of the design doc:
//! `http` over `db` over the components, the log and storage at the bottom, `error` a leaf).
//!
//! A module depends on another where its code (not its comments, not its unit tests) names a
//! `crate::other` path, in a `use` or inline. The graph is read from `src/` itself, so a new
//! edge that closes a cycle fails here with the files and lines that close it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Cycles known and not yet broken, each as its sorted module names: none. A cycle may leave
/// this list, never join it.
const KNOWN_CYCLES: &[&[&str]] = &[];

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("src/ is readable")
        .map(|e| e.expect("a directory entry").path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            sources(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code of a file without its comments and its unit tests (a `tests.rs` file, or what
/// follows `#[cfg(test)]` at the start of a line, which is where this crate keeps them).
fn production_lines(path: &Path, text: &str) -> Vec<(usize, String)> {
    if path.file_name().is_some_and(|n| n == "tests.rs") {
        return Vec::new();
    }
    let mut lines = Vec::new();
    for (n, line) in text.lines().enumerate() {
        if line.starts_with("#[cfg(test)]") {
            break;
        }
        let code = line.split("//").next().unwrap_or("");
        lines.push((n + 1, code.to_string()));
    }
    lines
}

/// The top-level modules each names on a line: `crate::x` and `crate::{x, y::z}`.
fn named_modules(code: &str, modules: &BTreeSet<String>) -> Vec<String> {
    let mut named = Vec::new();
    let mut rest = code;
    while let Some(at) = rest.find("crate::") {
        rest = &rest[at + "crate::".len()..];
        let list: Vec<&str> = if let Some(inner) = rest.strip_prefix('{') {
            let end = inner.find('}').unwrap_or(inner.len());
            inner[..end].split(',').collect()
        } else {
            vec![rest]
        };
        for item in list {
            let name: String = item
                .trim()
                .chars()
                .take_while(|c| c.is_alphanumeric() || *c == '_')
                .collect();
            if modules.contains(&name) {
                named.push(name);
            }
        }
    }
    named
}

/// Strongly connected components with more than one module (Tarjan).
fn cycles(edges: &BTreeMap<String, BTreeMap<String, Vec<String>>>) -> Vec<Vec<String>> {
    struct Walk<'a> {
        edges: &'a BTreeMap<String, BTreeMap<String, Vec<String>>>,
        index: BTreeMap<&'a str, usize>,
        low: BTreeMap<&'a str, usize>,
        stack: Vec<&'a str>,
        found: Vec<Vec<String>>,
    }
    impl<'a> Walk<'a> {
        fn visit(&mut self, v: &'a str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            for w in self.edges.get(v).into_iter().flat_map(|m| m.keys()) {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let lw = self.low[w.as_str()];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(lw);
                } else if self.stack.contains(&w.as_str()) {
                    let iw = self.index[w.as_str()];
                    let lv = self.low.get_mut(v).expect("visited");
                    *lv = (*lv).min(iw);
                }
            }
            if self.low[v] == self.index[v] {
                let mut component = Vec::new();
                while let Some(w) = self.stack.pop() {
                    component.push(w.to_string());
                    if w == v {
                        break;
                    }
                }
                if component.len() > 1 {
                    component.sort();
                    self.found.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        edges,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        found: Vec::new(),
    };
    for v in edges.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    walk.found
}

#[test]
fn the_top_level_modules_form_no_import_cycle() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut modules = BTreeSet::new();
    for entry in std::fs::read_dir(&src).expect("src/ is readable") {
        let path = entry.expect("a directory entry").path();
        let stem = path.file_stem().and_then(|s| s.to_str()).unwrap_or("");
        if (path.is_dir() || path.extension().is_some_and(|e| e == "rs"))
            && !matches!(stem, "lib" | "main")
        {
            modules.insert(stem.to_string());
        }
    }
    assert!(
        modules.contains("db") && modules.contains("log"),
        "{modules:?}"
    );

    let mut files = Vec::new();
    sources(&src, &mut files);
    let mut edges: BTreeMap<String, BTreeMap<String, Vec<String>>> = BTreeMap::new();
    for path in &files {
        let relative = path.strip_prefix(&src).expect("under src/");
        let first = relative
            .components()
            .next()
            .and_then(|c| c.as_os_str().to_str())
            .unwrap_or("");
        let from = first.strip_suffix(".rs").unwrap_or(first).to_string();
        if !modules.contains(&from) {
            continue;
        }
        let text = std::fs::read_to_string(path).expect("a source file");
        edges.entry(from.clone()).or_default();
        for (line, code) in production_lines(path, &text) {
            for to in named_modules(&code, &modules) {
                if to != from {
                    edges
                        .entry(from.clone())
                        .or_default()
                        .entry(to)
                        .or_default()
                        .push(format!("{}:{line}", relative.display()));
                }
            }
        }
    }
    // The check must see the crate's real dependencies, or it proves nothing.
    assert!(
        edges.get("http").is_some_and(|m| m.contains_key("db")),
        "the graph misses http -> db: {edges:?}"
    );

    let known: BTreeSet<Vec<String>> = KNOWN_CYCLES
        .iter()
        .map(|c| c.iter().map(|s| s.to_string()).collect())
        .collect();
    let mut report = String::new();
    for cycle in cycles(&edges) {
        if known.contains(&cycle) {
            continue;
        }
        report.push_str(&format!("cycle among {cycle:?}; its edges:\n"));
        for from in &cycle {
            for (to, at) in &edges[from] {
                if cycle.contains(to) {
                    report.push_str(&format!("  {from} -> {to} at {}\n", at.join(", ")));
                }
            }
        }
    }
    assert!(
        report.is_empty(),
        "import cycles between top-level modules:\n{report}"
    );
    assert!(
        edges.get("error").is_none_or(|m| m.is_empty()),
        "error is a leaf: it imports {:?}",
        edges.get("error")
    );
}
