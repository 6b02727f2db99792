//! Statements parsed once and classified by what they will do.
//!
//! Every statement text is parsed exactly once, here, into a [`Prepared`] statement; its
//! [`Access`] (what role it needs) is decided from that parse, and the same parse is what
//! runs. There is no second reading of the text that could disagree with the first.
//!
//! - sluice's catalog statements ([`super::ddl`]) run on sluice's catalog;
//! - ScopeQL pipelines ([`super::scopeql`]) become SQL queries, with a final `INSERT INTO`
//!   becoming an [`Insert`];
//! - SQL is parsed by DataFusion's parser. Only queries (`SELECT`, `WITH`, `VALUES`,
//!   `EXPLAIN [ANALYZE]` of a query, `SHOW COLUMNS`) and plain `INSERT INTO t [(cols)]
//!   VALUES|SELECT` are accepted; every other statement kind (`COPY`, `CREATE EXTERNAL
//!   TABLE`, `SET`, `DELETE`, views, transactions, …) is refused before anything runs.
//!
//! Before either parser sees a statement, [`check_size`] bounds its length and the depth of
//! the expressions it can build, so that no parser, planner or destructor recursing on it
//! can exhaust a thread's stack. Once parsed, a SQL statement whose common table expressions
//! expand past what may be planned is refused ([`super::plan_limits::check_expansion`]): SQL
//! planning would take exponential time on it.

use datafusion::sql::parser::{DFParserBuilder, Statement as DfStatement};
use datafusion::sql::sqlparser::ast::{
    Ident, Query, SetExpr, Statement as SqlStatement, TableObject,
};
use datafusion::sql::sqlparser::dialect::GenericDialect;

use super::ddl::{self, Ddl};
use super::{QueryError, lex, scopeql};

/// Longest statement text accepted, in bytes.
pub(crate) const MAX_STATEMENT_BYTES: usize = 1 << 20;

/// Deepest expression accepted, as [`lex::expression_depth`] estimates it. Statements run on
/// threads with large stacks ([`super::runtime`]), where parsing, planning and running
/// expressions this deep takes a small part of the stack (measured: a debug build with
/// 2 MiB stacks overflowed past about 300 levels of `1+1+...`, so 64 MiB stacks hold
/// about 30 times that; release builds use less per level).
pub(crate) const MAX_EXPRESSION_DEPTH: usize = 1000;

/// sqlparser's own limit on nested constructs (subqueries, parenthesized expressions). Above
/// DataFusion's default of 50, because ScopeQL's translation parenthesizes every operation
/// (`1+1+…` of 60 terms would not parse); [`check_size`] bounds the depth beforehand.
const PARSER_RECURSION_LIMIT: usize = 256;

/// What a statement needs to be allowed to run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Access {
    /// It only reads.
    Read,
    /// It writes rows.
    Write,
    /// It changes the catalog.
    Admin,
}

/// How the columns of an `INSERT`'s source map onto the table's columns.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum InsertColumns {
    /// By the source's column names (ScopeQL's `INSERT INTO`).
    ByName,
    /// The i-th source column fills the i-th named column (`INSERT INTO t (a, b) ...`).
    Listed(Vec<String>),
    /// The i-th source column fills the table's i-th input (not computed) column.
    Positional,
}

/// An insert: rows a query produces, written to a table through the database's write path.
#[derive(Debug, Clone)]
pub(crate) struct Insert {
    /// The table's name, one to three parts.
    pub(crate) table: Vec<String>,
    /// How source columns map to table columns.
    pub(crate) columns: InsertColumns,
    /// The query producing the rows (always a query: see [`Prepared::Query`]).
    pub(crate) source: Box<DfStatement>,
}

/// A statement, parsed once.
#[derive(Debug, Clone)]
pub(crate) enum Prepared {
    /// One of sluice's catalog statements.
    Catalog(Ddl),
    /// A read-only query for DataFusion: its plan is checked again to be free of DDL, DML
    /// and session statements before it runs.
    Query(Box<DfStatement>),
    /// Rows inserted into a table.
    Insert(Insert),
}

impl Prepared {
    /// What the statement needs to run.
    pub(crate) fn access(&self) -> Access {
        match self {
            Prepared::Catalog(
                Ddl::Describe { .. } | Ddl::ShowTables | Ddl::ShowDatabases | Ddl::ShowSchemas,
            ) => Access::Read,
            Prepared::Catalog(_) => Access::Admin,
            Prepared::Query(_) => Access::Read,
            Prepared::Insert(_) => Access::Write,
        }
    }
}

/// What parsing and planning take per byte of a statement's text, at most: measured with a
/// statement of a million bytes made of `(1),` (a `VALUES` row of one literal every four
/// bytes, the densest text there is in syntax nodes), whose syntax tree, logical and
/// physical plans took about 650 bytes of the server's memory per byte of text.
pub(crate) const TEXT_BYTE_COST: usize = 700;

/// What a statement's syntax tree and plans can take (see [`TEXT_BYTE_COST`]), reserved
/// before it is parsed.
pub(crate) fn text_bytes(text: &str) -> usize {
    text.len().saturating_mul(TEXT_BYTE_COST)
}

/// Refuses statements too long, or whose expressions nest too deeply, to parse safely.
pub(crate) fn check_size(text: &str) -> Result<(), QueryError> {
    if text.len() > MAX_STATEMENT_BYTES {
        return Err(QueryError::TooComplex(format!(
            "statement is {} bytes; the limit is {MAX_STATEMENT_BYTES}",
            text.len()
        )));
    }
    let depth = lex::expression_depth(text);
    if depth > MAX_EXPRESSION_DEPTH {
        return Err(QueryError::TooComplex(format!(
            "expressions nest about {depth} levels deep; the limit is {MAX_EXPRESSION_DEPTH}"
        )));
    }
    Ok(())
}

/// Parses and classifies one statement.
pub(crate) fn prepare(text: &str) -> Result<Prepared, QueryError> {
    check_size(text)?;
    match ddl::parse(text) {
        Ok(Some(ddl)) => return Ok(Prepared::Catalog(ddl)),
        Ok(None) => {}
        Err(ddl::DdlError { message, offset }) => {
            return Err(QueryError::syntax(text, message, offset));
        }
    }
    if scopeql::is_scopeql(text) {
        let pipeline = scopeql::parse(text)
            .map_err(|e| QueryError::syntax(text, e.message.clone(), e.offset))?;
        // The translation joins clauses (a WHERE per clause, say) into one tree: it is held
        // to the same depth as SQL.
        let sql = pipeline.to_sql();
        check_size(&sql)?;
        let source = parse_one_sql(&sql)?;
        super::plan_limits::check_expansion(&source)?;
        let source = Box::new(source);
        return Ok(match pipeline.insert_into {
            Some(table) => Prepared::Insert(Insert {
                table,
                columns: InsertColumns::ByName,
                source,
            }),
            None => Prepared::Query(source),
        });
    }
    let statement = parse_one_sql(text)?;
    // Common table expressions that expand past what may be planned are refused here, before
    // SQL planning, which walks every copy.
    super::plan_limits::check_expansion(&statement)?;
    classify(statement)
}

/// Parses exactly one SQL statement with DataFusion's parser.
fn parse_one_sql(sql: &str) -> Result<DfStatement, QueryError> {
    let dialect = GenericDialect {};
    let mut statements = DFParserBuilder::new(sql)
        .with_dialect(&dialect)
        .with_recursion_limit(PARSER_RECURSION_LIMIT)
        .build()
        .and_then(|mut p| p.parse_statements())
        .map_err(|e| QueryError::Syntax {
            message: e.strip_backtrace(),
            line: 0,
            column: 0,
        })?;
    match (statements.pop_front(), statements.is_empty()) {
        (Some(statement), true) => Ok(statement),
        (None, _) => Err(QueryError::Syntax {
            message: "empty statement".into(),
            line: 0,
            column: 0,
        }),
        (Some(_), false) => Err(QueryError::Syntax {
            message: "one statement at a time".into(),
            line: 0,
            column: 0,
        }),
    }
}

fn unsupported(what: impl std::fmt::Display) -> QueryError {
    QueryError::Unsupported(format!(
        "{what} is not supported; statements are queries (SELECT, WITH, VALUES, EXPLAIN, SHOW \
         COLUMNS), INSERT INTO, and sluice's catalog statements"
    ))
}

/// Accepts the SQL statement kinds sluice runs and refuses the rest.
fn classify(statement: DfStatement) -> Result<Prepared, QueryError> {
    match statement {
        DfStatement::Statement(s) => match *s {
            SqlStatement::Query(ref q) if !plain_query(q) => Err(unsupported(
                "a query that writes (SELECT INTO, or INSERT, UPDATE or DELETE inside a query)",
            )),
            SqlStatement::Query(_) | SqlStatement::ShowColumns { .. } => {
                Ok(Prepared::Query(Box::new(DfStatement::Statement(s))))
            }
            SqlStatement::Explain { ref statement, .. } => {
                if is_query(statement) {
                    Ok(Prepared::Query(Box::new(DfStatement::Statement(s))))
                } else {
                    Err(unsupported("EXPLAIN of anything but a query"))
                }
            }
            SqlStatement::Insert(insert) => {
                let TableObject::TableName(name) = &insert.table else {
                    return Err(unsupported("INSERT INTO a table function"));
                };
                let Some(source) = &insert.source else {
                    return Err(unsupported("INSERT without VALUES or SELECT"));
                };
                let columns: Vec<String> = insert.columns.iter().map(|c| c.to_string()).collect();
                // Any clause beyond `INSERT INTO t [(cols)] <query>` (OVERWRITE, ON CONFLICT,
                // RETURNING, PARTITION, SETTINGS, …) shows up as a difference here.
                let plain = format!(
                    "INSERT INTO {name}{} {source}",
                    if columns.is_empty() {
                        String::new()
                    } else {
                        format!(" ({})", columns.join(", "))
                    }
                );
                if insert.to_string() != plain {
                    return Err(unsupported(
                        "INSERT with clauses other than a column list and VALUES or SELECT",
                    ));
                }
                let table = name
                    .0
                    .iter()
                    .map(|part| {
                        part.as_ident()
                            .map(normalized)
                            .ok_or_else(|| unsupported("this table name"))
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                if table.is_empty() || table.len() > 3 {
                    return Err(QueryError::Syntax {
                        message: "a table name has one to three parts".into(),
                        line: 0,
                        column: 0,
                    });
                }
                let columns = if insert.columns.is_empty() {
                    InsertColumns::Positional
                } else {
                    // A column is named by one identifier: `x.k` names no column of the table.
                    InsertColumns::Listed(
                        insert
                            .columns
                            .iter()
                            .map(|c| match c.0.as_slice() {
                                [part] => part
                                    .as_ident()
                                    .map(normalized)
                                    .ok_or_else(|| unsupported("this column name")),
                                _ => Err(QueryError::Invalid(format!(
                                    "INSERT names column {c}: name a column of the table, without a qualifier"
                                ))),
                            })
                            .collect::<Result<_, _>>()?,
                    )
                };
                let source = Box::new(DfStatement::Statement(Box::new(SqlStatement::Query(
                    source.clone(),
                ))));
                Ok(Prepared::Insert(Insert {
                    table,
                    columns,
                    source,
                }))
            }
            other => Err(unsupported(statement_kind(&other))),
        },
        DfStatement::Explain(explain) => {
            if is_query(&explain.statement) {
                Ok(Prepared::Query(Box::new(DfStatement::Explain(explain))))
            } else {
                Err(unsupported("EXPLAIN of anything but a query"))
            }
        }
        DfStatement::CreateExternalTable(_) => Err(unsupported("CREATE EXTERNAL TABLE")),
        DfStatement::CopyTo(_) => Err(unsupported("COPY")),
        DfStatement::Reset(_) => Err(unsupported("RESET")),
    }
}

/// Whether an `EXPLAIN`'s statement is a query (possibly itself an `EXPLAIN` of one).
fn is_query<S: AsStatement>(statement: &S) -> bool {
    statement.is_query()
}

/// The statement types `EXPLAIN` can wrap: DataFusion's and sqlparser's.
trait AsStatement {
    fn is_query(&self) -> bool;
}

impl AsStatement for DfStatement {
    fn is_query(&self) -> bool {
        match self {
            DfStatement::Statement(s) => s.as_ref().is_query(),
            DfStatement::Explain(e) => e.statement.as_ref().is_query(),
            _ => false,
        }
    }
}

impl AsStatement for SqlStatement {
    fn is_query(&self) -> bool {
        match self {
            SqlStatement::Query(q) => plain_query(q),
            SqlStatement::Explain { statement, .. } => statement.as_ref().is_query(),
            _ => false,
        }
    }
}

impl<T: AsStatement> AsStatement for Box<T> {
    fn is_query(&self) -> bool {
        self.as_ref().is_query()
    }
}

/// Whether a query only reads: no `SELECT … INTO`, and no `INSERT`, `UPDATE`, `DELETE` or
/// `MERGE` in its body, set operations or common table expressions.
fn plain_query(query: &Query) -> bool {
    let ctes = query
        .with
        .as_ref()
        .is_none_or(|w| w.cte_tables.iter().all(|c| plain_query(&c.query)));
    ctes && plain_set(&query.body)
}

fn plain_set(body: &SetExpr) -> bool {
    match body {
        SetExpr::Select(select) => select.into.is_none(),
        SetExpr::Query(q) => plain_query(q),
        SetExpr::SetOperation { left, right, .. } => plain_set(left) && plain_set(right),
        SetExpr::Values(_) | SetExpr::Table(_) => true,
        _ => false,
    }
}

/// The first words of a statement, for error messages (`CREATE VIEW`, `SET`, …).
fn statement_kind(statement: &SqlStatement) -> String {
    let text = statement.to_string();
    let words: Vec<&str> = text.split_whitespace().take(2).collect();
    match words.as_slice() {
        [first, second]
            if matches!(
                first.to_ascii_uppercase().as_str(),
                "CREATE" | "DROP" | "ALTER" | "SHOW"
            ) =>
        {
            format!(
                "{} {}",
                first.to_ascii_uppercase(),
                second.to_ascii_uppercase()
            )
        }
        [first, ..] => first.to_ascii_uppercase(),
        [] => "this statement".into(),
    }
}

/// An identifier as DataFusion resolves it: unquoted ones are folded to ASCII lower case (as
/// DataFusion folds them: `K`, the Kelvin sign, stays), quoted ones kept as written, so an
/// `INSERT` names the same table and columns its source would.
pub(super) fn normalized(ident: &Ident) -> String {
    if ident.quote_style.is_some() {
        ident.value.clone()
    } else {
        ident.value.to_ascii_lowercase()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn access(text: &str) -> Result<Access, String> {
        prepare(text).map(|p| p.access()).map_err(|e| e.to_string())
    }

    #[test]
    fn statements_are_classed_by_what_they_do() {
        assert_eq!(access("SELECT 1"), Ok(Access::Read));
        assert_eq!(access(" -- c\n select 1"), Ok(Access::Read));
        assert_eq!(
            access("/* a /* nested */ comment */ SELECT 1"),
            Ok(Access::Read)
        );
        assert_eq!(access("EXPLAIN ANALYZE SELECT 1"), Ok(Access::Read));
        assert_eq!(access("SHOW TABLES"), Ok(Access::Read));
        assert_eq!(access("FROM t SELECT a"), Ok(Access::Read));
        assert_eq!(access("FROM t SELECT a INSERT INTO t"), Ok(Access::Write));
        assert_eq!(access("INSERT INTO t VALUES (1)"), Ok(Access::Write));
        assert_eq!(access("insert into t (a) select 1"), Ok(Access::Write));
        assert_eq!(access("CREATE TABLE t (a int)"), Ok(Access::Admin));
        assert_eq!(access("drop table t"), Ok(Access::Admin));
        assert_eq!(access("ALTER TABLE t ADD COLUMN c int"), Ok(Access::Admin));
        assert_eq!(
            access("alter table t rename column a to b"),
            Ok(Access::Admin)
        );
    }

    #[test]
    fn insert_names_fold_as_datafusion_folds_them() {
        assert_eq!(normalized(&Ident::new("AbC")), "abc");
        // Only ASCII folds: the Kelvin sign is not `k`.
        assert_eq!(normalized(&Ident::new("\u{212A}")), "\u{212A}");
        assert_eq!(normalized(&Ident::with_quote('"', "AbC")), "AbC");
        assert!(prepare("INSERT INTO t (x.k) VALUES (1)").is_err());
    }

    #[test]
    fn what_would_reach_the_host_or_the_session_is_refused_whatever_its_spelling() {
        for text in [
            "COPY t TO 'x'",
            "; COPY (SELECT 1) TO '/tmp/x.csv'",
            "EXPLAIN ANALYZE COPY (SELECT 1) TO '/tmp/x.csv'",
            "EXPLAIN COPY (SELECT 1) TO '/tmp/x.csv'",
            "EXPLAIN INSERT INTO t VALUES (1)",
            "/* x */ CREATE EXTERNAL TABLE x STORED AS CSV LOCATION '/etc'",
            "CREATE VIEW v AS SELECT 1",
            "SET datafusion.execution.target_partitions = 1",
            "DELETE FROM t",
            "UPDATE t SET a = 1",
            "INSERT OVERWRITE t SELECT 1",
            "INSERT INTO t VALUES (1) RETURNING a",
            "SELECT 1; SELECT 2",
            "BEGIN",
            "WITH a AS (SELECT 1) INSERT INTO t SELECT * FROM a",
            "SELECT 1 UNION ALL (INSERT INTO t VALUES (1))",
            "SELECT * INTO t2 FROM t",
            "EXPLAIN ANALYZE WITH a AS (SELECT 1) INSERT INTO t SELECT * FROM a",
            "WITH a AS (INSERT INTO t VALUES (1)) SELECT 1",
        ] {
            assert!(prepare(text).is_err(), "{text} was accepted");
        }
    }

    #[test]
    fn deep_expressions_are_refused_before_parsing() {
        let deep = format!("SELECT {}", vec!["1"; 5000].join("+"));
        assert!(matches!(prepare(&deep), Err(QueryError::TooComplex(_))));
        let parens = format!("FROM t SELECT {}1{}", "(".repeat(5000), ")".repeat(5000));
        assert!(matches!(prepare(&parens), Err(QueryError::TooComplex(_))));
        let ok = format!("SELECT {}", vec!["1"; 200].join("+"));
        assert!(prepare(&ok).is_ok());
        let unions = format!(
            "INSERT INTO t SELECT 1 AS a, 2 AS b{}",
            " UNION ALL SELECT 1, 2".repeat(6000)
        );
        assert!(matches!(prepare(&unions), Err(QueryError::TooComplex(_))));
        let wheres = format!("VALUES (true){}", " WHERE column1".repeat(8000));
        assert!(matches!(prepare(&wheres), Err(QueryError::TooComplex(_))));
        // ScopeQL chains that parse as SQL parse here too.
        let chain = format!("VALUES (1) SELECT {} AS x", vec!["1"; 60].join("+"));
        assert!(prepare(&chain).is_ok(), "{:?}", prepare(&chain).err());
    }

    #[test]
    fn insert_columns() {
        let Prepared::Insert(i) = prepare("INSERT INTO db.s.t (b, a) SELECT 1, 2").unwrap() else {
            panic!()
        };
        assert_eq!(i.table, vec!["db", "s", "t"]);
        assert_eq!(
            i.columns,
            InsertColumns::Listed(vec!["b".into(), "a".into()])
        );
        let Prepared::Insert(i) = prepare("FROM x SELECT a INSERT INTO t").unwrap() else {
            panic!()
        };
        assert_eq!(i.columns, InsertColumns::ByName);
    }
}
