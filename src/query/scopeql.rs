//! ScopeQL pipelines, translated clause by clause to SQL that DataFusion plans.
//!
//! A pipeline starts with `FROM t` (or `VALUES (...), ...`) and applies each clause to the
//! output of the one before, so a later clause sees an earlier one's aliases:
//!
//! ```text
//! FROM events
//! WHERE time = '2026-10-23T09:00:00Z'::timestamp AND service = 'checkout'
//! SELECT time, name, message, var['gateway']::string AS gateway
//! LIMIT 10
//! ```
//!
//! Each clause becomes one `SELECT` over the previous clause as a subquery. Access into JSON
//! columns (`v['k']`, `v[0]`, chains) becomes `datafusion-functions-json` calls, typed by a
//! following cast (`v['k']::string` reads a string). Syntax errors carry line and column.

use std::fmt::Write as _;

use crate::types::ColumnType;

/// A ScopeQL syntax error at a byte offset of the statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ScopeQlError {
    pub(crate) message: String,
    pub(crate) offset: usize,
}

/// Whether a statement is ScopeQL (it begins with `FROM` or `VALUES`).
pub(crate) fn is_scopeql(statement: &str) -> bool {
    let Ok(tokens) = tokenize(statement) else {
        return false;
    };
    matches!(tokens.first(), Some(t) if t.is_word("FROM") || t.is_word("VALUES"))
}

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Ident(String),
    Quoted(String),
    Str(String),
    Num(String),
    Op(&'static str),
}

#[derive(Debug, Clone)]
struct Token {
    tok: Tok,
    offset: usize,
}

impl Token {
    fn is_word(&self, w: &str) -> bool {
        matches!(&self.tok, Tok::Ident(s) if s.eq_ignore_ascii_case(w))
    }
}

const OPS: &[&str] = &[
    "=>", "::", "<=", ">=", "<>", "!=", "||", "=", "<", ">", "+", "-", "*", "/", "%", "(", ")",
    "[", "]", ",", ".", ";",
];

fn tokenize(src: &str) -> Result<Vec<Token>, ScopeQlError> {
    let b = src.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let err = |message: &str, offset| ScopeQlError {
        message: message.to_owned(),
        offset,
    };
    while i < b.len() {
        let c = b[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if let Some(end) = super::lex::skip_comment(src, i).map_err(|m| err(m, i))? {
            i = end;
        } else if c.is_ascii_alphabetic() || c == b'_' {
            let start = i;
            while i < b.len() && (b[i].is_ascii_alphanumeric() || b[i] == b'_') {
                i += 1;
            }
            out.push(Token {
                tok: Tok::Ident(src[start..i].to_owned()),
                offset: start,
            });
        } else if c.is_ascii_digit() {
            let start = i;
            while i < b.len() && (b[i].is_ascii_digit() || b[i] == b'.') {
                i += 1;
            }
            if i < b.len() && (b[i] == b'e' || b[i] == b'E') {
                i += 1;
                if i < b.len() && (b[i] == b'+' || b[i] == b'-') {
                    i += 1;
                }
                while i < b.len() && b[i].is_ascii_digit() {
                    i += 1;
                }
            }
            out.push(Token {
                tok: Tok::Num(src[start..i].to_owned()),
                offset: start,
            });
        } else if c == b'\'' || c == b'`' || c == b'"' {
            let start = i;
            let (text, end) =
                super::lex::read_quoted(src, start, c == b'\'').map_err(|m| err(m, start))?;
            i = end;
            out.push(Token {
                tok: if c == b'\'' {
                    Tok::Str(text)
                } else {
                    Tok::Quoted(text)
                },
                offset: start,
            });
        } else if let Some(op) = OPS.iter().find(|op| src[i..].starts_with(**op)) {
            out.push(Token {
                tok: Tok::Op(op),
                offset: i,
            });
            i += op.len();
        } else {
            let ch = src[i..].chars().next().unwrap_or('?');
            return Err(err(&format!("unexpected character {ch:?}"), i));
        }
    }
    Ok(out)
}

/// An expression.
#[derive(Debug, Clone, PartialEq)]
enum Expr {
    Column(Vec<String>),
    Str(String),
    Num(String),
    Bool(bool),
    Null,
    Unary(&'static str, Box<Expr>),
    Binary(Box<Expr>, String, Box<Expr>),
    IsNull(Box<Expr>, bool),
    Between(Box<Expr>, bool, Box<Expr>, Box<Expr>),
    InList(Box<Expr>, bool, Vec<Expr>),
    Like(Box<Expr>, bool, Box<Expr>),
    Case(Option<Box<Expr>>, Vec<(Expr, Expr)>, Option<Box<Expr>>),
    Call(String, Vec<(Option<String>, Expr)>, bool),
    Cast(Box<Expr>, ColumnType),
    Index(Box<Expr>, Box<Expr>),
    Star,
}

/// One pipeline clause.
#[derive(Debug, Clone, PartialEq)]
enum Clause {
    Select(Vec<(Expr, Option<String>)>),
    Where(Expr),
    Aggregate(Vec<Expr>, Vec<(Expr, Option<String>)>),
    DistinctOn(Vec<Expr>, Vec<(Expr, bool, Option<bool>)>),
    OrderBy(Vec<(Expr, bool, Option<bool>)>),
    Limit(String, Option<String>),
}

/// A parsed pipeline.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Pipeline {
    source: Source,
    clauses: Vec<Clause>,
    /// `INSERT INTO` target at the end.
    pub(crate) insert_into: Option<Vec<String>>,
}

#[derive(Debug, Clone, PartialEq)]
enum Source {
    Table(Vec<String>),
    Values(Vec<Vec<Expr>>),
}

struct Parser {
    tokens: Vec<Token>,
    pos: usize,
    end: usize,
}

fn binding_power(op: &str) -> Option<u8> {
    Some(match op {
        "OR" => 1,
        "AND" => 2,
        "=" | "!=" | "<>" | "<" | "<=" | ">" | ">=" | "IS" | "BETWEEN" | "IN" | "LIKE" | "NOT" => 4,
        "||" => 5,
        "+" | "-" => 6,
        "*" | "/" | "%" => 7,
        _ => return None,
    })
}

const CLAUSE_WORDS: &[&str] = &[
    "SELECT",
    "WHERE",
    "GROUP",
    "AGGREGATE",
    "DISTINCT",
    "ORDER",
    "LIMIT",
    "OFFSET",
    "INSERT",
];

impl Parser {
    fn peek(&self) -> Option<&Token> {
        self.tokens.get(self.pos)
    }

    fn offset(&self) -> usize {
        self.peek().map_or(self.end, |t| t.offset)
    }

    fn error<T>(&self, message: impl Into<String>) -> Result<T, ScopeQlError> {
        Err(ScopeQlError {
            message: message.into(),
            offset: self.offset(),
        })
    }

    fn word(&mut self, w: &str) -> bool {
        if self.peek().is_some_and(|t| t.is_word(w)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect_word(&mut self, w: &str) -> Result<(), ScopeQlError> {
        if self.word(w) {
            Ok(())
        } else {
            self.error(format!("expected {w}"))
        }
    }

    fn op(&mut self, o: &str) -> bool {
        if matches!(self.peek(), Some(Token { tok: Tok::Op(x), .. }) if *x == o) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn expect_op(&mut self, o: &str) -> Result<(), ScopeQlError> {
        if self.op(o) {
            Ok(())
        } else {
            self.error(format!("expected '{o}'"))
        }
    }

    fn at_clause_start(&self) -> bool {
        self.peek()
            .is_some_and(|t| CLAUSE_WORDS.iter().any(|w| t.is_word(w)))
            || self.peek().is_none()
            || matches!(
                self.peek(),
                Some(Token {
                    tok: Tok::Op(";"),
                    ..
                })
            )
    }

    fn ident(&mut self) -> Result<String, ScopeQlError> {
        match self.peek().map(|t| t.tok.clone()) {
            Some(Tok::Ident(s)) | Some(Tok::Quoted(s)) => {
                self.pos += 1;
                Ok(s)
            }
            _ => self.error("expected a name"),
        }
    }

    fn name(&mut self) -> Result<Vec<String>, ScopeQlError> {
        let mut parts = vec![self.ident()?];
        while self.op(".") {
            parts.push(self.ident()?);
        }
        Ok(parts)
    }

    fn column_type(&mut self) -> Result<ColumnType, ScopeQlError> {
        let offset = self.offset();
        let name = self.ident()?;
        name.parse()
            .map_err(|e: crate::types::UnknownTypeError| ScopeQlError {
                message: e.to_string(),
                offset,
            })
    }

    fn expr(&mut self, min_bp: u8) -> Result<Expr, ScopeQlError> {
        let mut lhs = self.prefix()?;
        while let Some(t) = self.peek() {
            let op = match &t.tok {
                Tok::Op(o) => (*o).to_owned(),
                Tok::Ident(w) => w.to_ascii_uppercase(),
                _ => break,
            };
            let Some(bp) = binding_power(&op) else { break };
            if bp < min_bp {
                break;
            }
            self.pos += 1;
            lhs = match op.as_str() {
                "IS" => {
                    let not = self.word("NOT");
                    self.expect_word("NULL")?;
                    Expr::IsNull(Box::new(lhs), not)
                }
                "NOT" | "BETWEEN" | "IN" | "LIKE" => {
                    let negated = op == "NOT";
                    let what = if negated {
                        match self.ident()?.to_ascii_uppercase().as_str() {
                            w @ ("BETWEEN" | "IN" | "LIKE") => w.to_owned(),
                            _ => return self.error("expected BETWEEN, IN or LIKE after NOT"),
                        }
                    } else {
                        op.clone()
                    };
                    match what.as_str() {
                        "BETWEEN" => {
                            let lo = self.expr(bp + 1)?;
                            self.expect_word("AND")?;
                            let hi = self.expr(bp + 1)?;
                            Expr::Between(Box::new(lhs), negated, Box::new(lo), Box::new(hi))
                        }
                        "IN" => {
                            self.expect_op("(")?;
                            let mut items = Vec::new();
                            loop {
                                items.push(self.expr(0)?);
                                if !self.op(",") {
                                    break;
                                }
                            }
                            self.expect_op(")")?;
                            Expr::InList(Box::new(lhs), negated, items)
                        }
                        _ => {
                            let pattern = self.expr(bp + 1)?;
                            Expr::Like(Box::new(lhs), negated, Box::new(pattern))
                        }
                    }
                }
                _ => {
                    let rhs = self.expr(bp + 1)?;
                    Expr::Binary(Box::new(lhs), op, Box::new(rhs))
                }
            };
        }
        Ok(lhs)
    }

    fn prefix(&mut self) -> Result<Expr, ScopeQlError> {
        let Some(t) = self.peek().cloned() else {
            return self.error("expected an expression");
        };
        self.pos += 1;
        let mut e = match t.tok {
            Tok::Str(s) => Expr::Str(s),
            Tok::Num(n) => Expr::Num(n),
            Tok::Op("(") => {
                let e = self.expr(0)?;
                self.expect_op(")")?;
                e
            }
            Tok::Op("-") => Expr::Unary("-", Box::new(self.expr(8)?)),
            Tok::Op("+") => self.expr(8)?,
            Tok::Op("*") => Expr::Star,
            Tok::Quoted(name) => self.column_rest(name)?,
            Tok::Ident(w) => match w.to_ascii_uppercase().as_str() {
                "TRUE" => Expr::Bool(true),
                "FALSE" => Expr::Bool(false),
                "NULL" => Expr::Null,
                "NOT" => Expr::Unary("NOT", Box::new(self.expr(3)?)),
                "CAST" => {
                    self.expect_op("(")?;
                    let e = self.expr(0)?;
                    self.expect_word("AS")?;
                    let t = self.column_type()?;
                    self.expect_op(")")?;
                    Expr::Cast(Box::new(e), t)
                }
                "CASE" => self.case()?,
                _ => {
                    if self.op("(") {
                        self.call(w)?
                    } else {
                        self.column_rest(w)?
                    }
                }
            },
            Tok::Op(o) => {
                self.pos -= 1;
                return self.error(format!("unexpected '{o}'"));
            }
        };
        // Postfix: [index] and ::type, left to right.
        loop {
            if self.op("[") {
                let index = self.expr(0)?;
                self.expect_op("]")?;
                e = Expr::Index(Box::new(e), Box::new(index));
            } else if self.op("::") {
                e = Expr::Cast(Box::new(e), self.column_type()?);
            } else {
                break;
            }
        }
        Ok(e)
    }

    fn column_rest(&mut self, first: String) -> Result<Expr, ScopeQlError> {
        let mut parts = vec![first];
        while self.op(".") {
            parts.push(self.ident()?);
        }
        Ok(Expr::Column(parts))
    }

    fn call(&mut self, name: String) -> Result<Expr, ScopeQlError> {
        let mut args = Vec::new();
        let distinct = self.word("DISTINCT");
        if !self.op(")") {
            loop {
                // A named argument: name => value.
                let named = match (self.tokens.get(self.pos), self.tokens.get(self.pos + 1)) {
                    (
                        Some(Token {
                            tok: Tok::Ident(n), ..
                        }),
                        Some(Token {
                            tok: Tok::Op("=>"), ..
                        }),
                    ) => {
                        // Only known named arguments are translated; passing others by
                        // position would silently change their meaning.
                        if !(name.eq_ignore_ascii_case("trunc") && n.eq_ignore_ascii_case("unit")) {
                            return self.error(format!(
                                "named argument {n} is not supported by {name}; the supported one is trunc(ts, unit => '...')"
                            ));
                        }
                        self.pos += 2;
                        Some("unit".to_owned())
                    }
                    _ => None,
                };
                args.push((named, self.expr(0)?));
                if self.op(")") {
                    break;
                }
                self.expect_op(",")?;
                if self.op(")") {
                    break;
                }
            }
        }
        Ok(Expr::Call(name, args, distinct))
    }

    fn case(&mut self) -> Result<Expr, ScopeQlError> {
        let operand = if self.peek().is_some_and(|t| t.is_word("WHEN")) {
            None
        } else {
            Some(Box::new(self.expr(0)?))
        };
        let mut arms = Vec::new();
        while self.word("WHEN") {
            let when = self.expr(0)?;
            self.expect_word("THEN")?;
            arms.push((when, self.expr(0)?));
        }
        if arms.is_empty() {
            return self.error("CASE needs at least one WHEN");
        }
        let otherwise = if self.word("ELSE") {
            Some(Box::new(self.expr(0)?))
        } else {
            None
        };
        self.expect_word("END")?;
        Ok(Expr::Case(operand, arms, otherwise))
    }

    /// `expr [AS alias]` items, allowing a trailing comma.
    fn items(&mut self) -> Result<Vec<(Expr, Option<String>)>, ScopeQlError> {
        let mut items = Vec::new();
        loop {
            let e = self.expr(0)?;
            let alias = if self.word("AS") {
                Some(self.ident()?)
            } else {
                None
            };
            items.push((e, alias));
            if !self.op(",") || self.at_clause_start() {
                break;
            }
        }
        Ok(items)
    }

    fn exprs(&mut self) -> Result<Vec<Expr>, ScopeQlError> {
        let mut items = Vec::new();
        loop {
            items.push(self.expr(0)?);
            if !self.op(",") || self.at_clause_start() {
                break;
            }
        }
        Ok(items)
    }

    fn order_items(&mut self) -> Result<Vec<(Expr, bool, Option<bool>)>, ScopeQlError> {
        let mut items = Vec::new();
        loop {
            let e = self.expr(0)?;
            let desc = if self.word("DESC") {
                true
            } else {
                self.word("ASC");
                false
            };
            let nulls_first = if self.word("NULLS") {
                if self.word("FIRST") {
                    Some(true)
                } else {
                    self.expect_word("LAST")?;
                    Some(false)
                }
            } else {
                None
            };
            items.push((e, desc, nulls_first));
            if !self.op(",") || self.at_clause_start() {
                break;
            }
        }
        Ok(items)
    }

    fn number(&mut self) -> Result<String, ScopeQlError> {
        match self.peek().map(|t| t.tok.clone()) {
            Some(Tok::Num(n)) if n.bytes().all(|b| b.is_ascii_digit()) => {
                self.pos += 1;
                Ok(n)
            }
            _ => self.error("expected a whole number"),
        }
    }

    fn pipeline(&mut self) -> Result<Pipeline, ScopeQlError> {
        let source = if self.word("FROM") {
            Source::Table(self.name()?)
        } else if self.word("VALUES") {
            let mut rows = Vec::new();
            loop {
                self.expect_op("(")?;
                let mut row = Vec::new();
                loop {
                    row.push(self.expr(0)?);
                    if !self.op(",") {
                        break;
                    }
                }
                self.expect_op(")")?;
                rows.push(row);
                if !self.op(",") {
                    break;
                }
            }
            Source::Values(rows)
        } else {
            return self.error("a ScopeQL statement starts with FROM or VALUES");
        };
        let mut clauses = Vec::new();
        let mut insert_into = None;
        loop {
            if self.op(";") || self.peek().is_none() {
                if self.peek().is_some() {
                    return self.error("one statement at a time");
                }
                break;
            }
            if insert_into.is_some() {
                return self.error("INSERT INTO must be the last clause");
            }
            if self.word("SELECT") {
                clauses.push(Clause::Select(self.items()?));
            } else if self.word("WHERE") {
                clauses.push(Clause::Where(self.expr(0)?));
            } else if self.word("GROUP") {
                self.expect_word("BY")?;
                let keys = self.exprs()?;
                self.expect_word("AGGREGATE")?;
                clauses.push(Clause::Aggregate(keys, self.items()?));
            } else if self.word("AGGREGATE") {
                clauses.push(Clause::Aggregate(Vec::new(), self.items()?));
            } else if self.word("DISTINCT") {
                self.expect_word("ON")?;
                let keys = self.exprs()?;
                let order = if self.word("BY") {
                    self.order_items()?
                } else {
                    Vec::new()
                };
                clauses.push(Clause::DistinctOn(keys, order));
            } else if self.word("ORDER") {
                self.expect_word("BY")?;
                clauses.push(Clause::OrderBy(self.order_items()?));
            } else if self.word("LIMIT") {
                let n = self.number()?;
                let offset = if self.word("OFFSET") {
                    Some(self.number()?)
                } else {
                    None
                };
                clauses.push(Clause::Limit(n, offset));
            } else if self.word("INSERT") {
                self.expect_word("INTO")?;
                insert_into = Some(self.name()?);
            } else {
                return self.error("expected a clause: SELECT, WHERE, GROUP BY, AGGREGATE, DISTINCT ON, ORDER BY, LIMIT or INSERT INTO");
            }
        }
        Ok(Pipeline {
            source,
            clauses,
            insert_into,
        })
    }
}

/// Parses a ScopeQL pipeline.
pub(crate) fn parse(src: &str) -> Result<Pipeline, ScopeQlError> {
    let tokens = tokenize(src)?;
    let mut p = Parser {
        tokens,
        pos: 0,
        end: src.len(),
    };
    p.pipeline()
}

fn quote_ident(s: &str) -> String {
    format!("\"{}\"", s.replace('"', "\"\""))
}

fn quote_str(s: &str) -> String {
    format!("'{}'", s.replace('\'', "''"))
}

fn sql_type(t: ColumnType) -> &'static str {
    match t {
        ColumnType::Int => "BIGINT",
        ColumnType::UInt => "BIGINT UNSIGNED",
        ColumnType::Float => "DOUBLE",
        ColumnType::Boolean => "BOOLEAN",
        ColumnType::String | ColumnType::Object | ColumnType::Array | ColumnType::Any => "VARCHAR",
        ColumnType::Timestamp => "TIMESTAMP",
        ColumnType::Interval => "INTERVAL",
        ColumnType::Binary => "BYTEA",
    }
}

/// Flattens `v['a'][0]` into the base expression and the path.
fn json_path(e: &Expr) -> Option<(&Expr, Vec<&Expr>)> {
    match e {
        Expr::Index(base, key) => match json_path(base) {
            Some((root, mut path)) => {
                path.push(key);
                Some((root, path))
            }
            None => Some((base, vec![key])),
        },
        _ => None,
    }
}

fn render_json_access(out: &mut String, function: &str, root: &Expr, path: &[&Expr]) {
    let _ = write!(out, "{function}(");
    render(out, root);
    for key in path {
        out.push_str(", ");
        render(out, key);
    }
    out.push(')');
}

fn render(out: &mut String, e: &Expr) {
    match e {
        Expr::Column(parts) => {
            let quoted: Vec<String> = parts.iter().map(|p| quote_ident(p)).collect();
            out.push_str(&quoted.join("."));
        }
        Expr::Str(s) => out.push_str(&quote_str(s)),
        Expr::Num(n) => out.push_str(n),
        Expr::Bool(b) => out.push_str(if *b { "TRUE" } else { "FALSE" }),
        Expr::Null => out.push_str("NULL"),
        Expr::Star => out.push('*'),
        Expr::Unary(op, inner) => {
            let _ = write!(out, "({op} ");
            render(out, inner);
            out.push(')');
        }
        Expr::Binary(l, op, r) => {
            out.push('(');
            render(out, l);
            let _ = write!(out, " {op} ");
            render(out, r);
            out.push(')');
        }
        Expr::IsNull(inner, not) => {
            out.push('(');
            render(out, inner);
            out.push_str(if *not { " IS NOT NULL)" } else { " IS NULL)" });
        }
        Expr::Between(v, not, lo, hi) => {
            out.push('(');
            render(out, v);
            out.push_str(if *not { " NOT BETWEEN " } else { " BETWEEN " });
            render(out, lo);
            out.push_str(" AND ");
            render(out, hi);
            out.push(')');
        }
        Expr::InList(v, not, items) => {
            out.push('(');
            render(out, v);
            out.push_str(if *not { " NOT IN (" } else { " IN (" });
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                render(out, item);
            }
            out.push_str("))");
        }
        Expr::Like(v, not, pattern) => {
            out.push('(');
            render(out, v);
            out.push_str(if *not { " NOT LIKE " } else { " LIKE " });
            render(out, pattern);
            out.push(')');
        }
        Expr::Case(operand, arms, otherwise) => {
            out.push_str("CASE");
            if let Some(o) = operand {
                out.push(' ');
                render(out, o);
            }
            for (when, then) in arms {
                out.push_str(" WHEN ");
                render(out, when);
                out.push_str(" THEN ");
                render(out, then);
            }
            if let Some(o) = otherwise {
                out.push_str(" ELSE ");
                render(out, o);
            }
            out.push_str(" END");
        }
        Expr::Call(name, args, distinct) => render_call(out, name, args, *distinct),
        Expr::Cast(inner, t) => match json_path(inner) {
            // A typed read out of a JSON value.
            Some((root, path)) => {
                let function = match t {
                    ColumnType::String => "json_get_str",
                    ColumnType::Int | ColumnType::UInt => "json_get_int",
                    ColumnType::Float => "json_get_float",
                    ColumnType::Boolean => "json_get_bool",
                    ColumnType::Object | ColumnType::Array | ColumnType::Any => "json_get_json",
                    ColumnType::Timestamp | ColumnType::Interval | ColumnType::Binary => {
                        out.push_str("CAST(");
                        render_json_access(out, "json_get_str", root, &path);
                        let _ = write!(out, " AS {})", sql_type(*t));
                        return;
                    }
                };
                render_json_access(out, function, root, &path);
            }
            None => {
                out.push_str("CAST(");
                render(out, inner);
                let _ = write!(out, " AS {})", sql_type(*t));
            }
        },
        Expr::Index(..) => match json_path(e) {
            // Untyped access keeps JSON: the value's JSON text.
            Some((root, path)) => render_json_access(out, "json_get_json", root, &path),
            None => out.push_str("NULL"),
        },
    }
}

fn render_call(out: &mut String, name: &str, args: &[(Option<String>, Expr)], distinct: bool) {
    let lower = name.to_ascii_lowercase();
    // `trunc(ts, unit => 'day')` is DataFusion's date_trunc('day', ts).
    if lower == "trunc"
        && let Some((_, unit)) = args.iter().find(|(n, _)| n.as_deref() == Some("unit"))
    {
        out.push_str("date_trunc(");
        render(out, unit);
        if let Some((_, ts)) = args.iter().find(|(n, _)| n.is_none()) {
            out.push_str(", ");
            render(out, ts);
        }
        out.push(')');
        return;
    }
    out.push_str(&lower);
    out.push('(');
    if distinct {
        out.push_str("DISTINCT ");
    }
    for (i, (_, a)) in args.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        render(out, a);
    }
    out.push(')');
}

fn render_items(out: &mut String, items: &[(Expr, Option<String>)]) {
    for (i, (e, alias)) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        render(out, e);
        let name = alias.clone().or_else(|| match e {
            // Keep a plain column's name, and name a JSON access after its last key.
            Expr::Column(parts) => parts.last().cloned(),
            Expr::Cast(inner, _) => match inner.as_ref() {
                Expr::Column(parts) => parts.last().cloned(),
                Expr::Index(_, key) => match key.as_ref() {
                    Expr::Str(k) => Some(k.clone()),
                    _ => None,
                },
                _ => None,
            },
            Expr::Index(_, key) => match key.as_ref() {
                Expr::Str(k) => Some(k.clone()),
                _ => None,
            },
            _ => None,
        });
        if let Some(name) = name {
            let _ = write!(out, " AS {}", quote_ident(&name));
        }
    }
}

fn render_order(out: &mut String, items: &[(Expr, bool, Option<bool>)]) {
    for (i, (e, desc, nulls_first)) in items.iter().enumerate() {
        if i > 0 {
            out.push_str(", ");
        }
        render(out, e);
        out.push_str(if *desc { " DESC" } else { " ASC" });
        match nulls_first {
            Some(true) => out.push_str(" NULLS FIRST"),
            Some(false) => out.push_str(" NULLS LAST"),
            None => {}
        }
    }
}

/// One SQL `SELECT` being built. Clauses fold into the current stage while SQL's clause order
/// allows it (so an `ORDER BY` keeps holding for a later `SELECT` or `LIMIT`), and otherwise
/// start a new stage over the current one as a subquery.
struct Stage {
    select: String,
    from: String,
    filters: Vec<String>,
    group_by: Option<String>,
    distinct_on: Option<String>,
    order_by: Option<String>,
    limit: Option<String>,
}

impl Stage {
    fn over(from: String) -> Stage {
        Stage {
            select: "*".into(),
            from,
            filters: Vec::new(),
            group_by: None,
            distinct_on: None,
            order_by: None,
            limit: None,
        }
    }

    /// Whether the stage is still `SELECT * FROM .. [WHERE ..] [ORDER BY ..]` with nothing that
    /// a following projection or filter would have to come after.
    fn is_plain(&self) -> bool {
        self.select == "*"
            && self.group_by.is_none()
            && self.distinct_on.is_none()
            && self.limit.is_none()
    }

    fn render(&self) -> String {
        let mut sql = String::from("SELECT ");
        if let Some(d) = &self.distinct_on {
            let _ = write!(sql, "DISTINCT ON ({d}) ");
        }
        let _ = write!(sql, "{} FROM {}", self.select, self.from);
        if !self.filters.is_empty() {
            let _ = write!(sql, " WHERE {}", self.filters.join(" AND "));
        }
        if let Some(g) = &self.group_by {
            let _ = write!(sql, " GROUP BY {g}");
        }
        if let Some(o) = &self.order_by {
            let _ = write!(sql, " ORDER BY {o}");
        }
        if let Some(l) = &self.limit {
            let _ = write!(sql, " {l}");
        }
        sql
    }
}

impl Pipeline {
    /// The SQL query the pipeline means (without its `INSERT INTO`).
    pub(crate) fn to_sql(&self) -> String {
        let source = match &self.source {
            Source::Table(name) => {
                let quoted: Vec<String> = name.iter().map(|p| quote_ident(p)).collect();
                quoted.join(".")
            }
            Source::Values(rows) => {
                let mut s = String::from("(VALUES ");
                for (i, row) in rows.iter().enumerate() {
                    if i > 0 {
                        s.push_str(", ");
                    }
                    s.push('(');
                    for (j, e) in row.iter().enumerate() {
                        if j > 0 {
                            s.push_str(", ");
                        }
                        render(&mut s, e);
                    }
                    s.push(')');
                }
                s.push_str(") AS _values");
                s
            }
        };
        let mut stage = Stage::over(source);
        for (idx, clause) in self.clauses.iter().enumerate() {
            let wrap = |stage: &Stage| Stage::over(format!("({}) AS _q{idx}", stage.render()));
            match clause {
                Clause::Select(items) => {
                    if !stage.is_plain() {
                        stage = wrap(&stage);
                    }
                    let mut select = String::new();
                    render_items(&mut select, items);
                    stage.select = select;
                }
                Clause::Where(e) => {
                    if !stage.is_plain() {
                        stage = wrap(&stage);
                    }
                    let mut filter = String::new();
                    render(&mut filter, e);
                    stage.filters.push(filter);
                }
                Clause::Aggregate(keys, items) => {
                    stage = wrap(&stage);
                    let key_items: Vec<(Expr, Option<String>)> =
                        keys.iter().map(|k| (k.clone(), None)).collect();
                    let mut select = String::new();
                    render_items(&mut select, &key_items);
                    if !keys.is_empty() && !items.is_empty() {
                        select.push_str(", ");
                    }
                    render_items(&mut select, items);
                    stage.select = select;
                    if !keys.is_empty() {
                        let mut group = String::new();
                        for (i, k) in keys.iter().enumerate() {
                            if i > 0 {
                                group.push_str(", ");
                            }
                            render(&mut group, k);
                        }
                        stage.group_by = Some(group);
                    }
                }
                Clause::DistinctOn(keys, order) => {
                    stage = wrap(&stage);
                    let mut on = String::new();
                    for (i, k) in keys.iter().enumerate() {
                        if i > 0 {
                            on.push_str(", ");
                        }
                        render(&mut on, k);
                    }
                    stage.distinct_on = Some(on);
                    if !order.is_empty() {
                        // DISTINCT ON keeps the first row of each key in this order.
                        let keys_first: Vec<(Expr, bool, Option<bool>)> = keys
                            .iter()
                            .map(|k| (k.clone(), false, None))
                            .chain(order.iter().cloned())
                            .collect();
                        let mut o = String::new();
                        render_order(&mut o, &keys_first);
                        stage.order_by = Some(o);
                    }
                }
                Clause::OrderBy(items) => {
                    if !stage.is_plain() || stage.order_by.is_some() {
                        stage = wrap(&stage);
                    }
                    let mut o = String::new();
                    render_order(&mut o, items);
                    stage.order_by = Some(o);
                }
                Clause::Limit(count, offset) => {
                    if stage.limit.is_some() {
                        stage = wrap(&stage);
                    }
                    let mut l = format!("LIMIT {count}");
                    if let Some(o) = offset {
                        let _ = write!(l, " OFFSET {o}");
                    }
                    stage.limit = Some(l);
                }
            }
        }
        stage.render()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_seed_query() {
        let q = "FROM events\nWHERE time = '2026-10-23T09:00:00Z'::timestamp\n  AND service = 'checkout'\n  AND name = 'payment_failed'\nSELECT time, name, message, var['gateway']::string AS gateway\nLIMIT 10";
        assert!(is_scopeql(q));
        let p = parse(q).unwrap();
        assert_eq!(p.clauses.len(), 3);
        let sql = p.to_sql();
        assert!(
            sql.contains("json_get_str(\"var\", 'gateway') AS \"gateway\""),
            "{sql}"
        );
        assert!(
            sql.contains("CAST('2026-10-23T09:00:00Z' AS TIMESTAMP)"),
            "{sql}"
        );
    }

    #[test]
    fn errors_have_offsets() {
        let e = parse("FROM t\nWHERE a = ").unwrap_err();
        assert_eq!(e.offset, 17);
        let e = parse("FROM t SELECT a::varchar").unwrap_err();
        assert!(e.message.contains("unknown column type"));
        assert!(parse("FROM t SELECT a, b, ORDER BY a LIMIT 5 INSERT INTO u").is_ok());
        assert!(parse("FROM t INSERT INTO u WHERE a").is_err());
    }
}
