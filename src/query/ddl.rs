//! The catalog statements sluice runs itself, with sluice's type names:
//!
//! ```text
//! CREATE TABLE [IF NOT EXISTS] [db.][schema.]t (col type [COMMENT '...'], ...)
//! CREATE DATABASE [IF NOT EXISTS] db
//! CREATE SCHEMA [IF NOT EXISTS] [db.]schema
//! DROP TABLE|SCHEMA|DATABASE [IF EXISTS] name
//! ALTER TABLE name ADD [COLUMN] [IF NOT EXISTS] col type [COMMENT '...']
//! ALTER TABLE name DROP [COLUMN] [IF EXISTS] col
//! ALTER TABLE name RENAME COLUMN col TO new_name
//! ALTER TABLE name ALTER [COLUMN] col SET COMMENT '...' | DROP COMMENT
//! DESCRIBE [TABLE] name
//! SHOW TABLES | SHOW DATABASES | SHOW SCHEMAS
//! ```
//!
//! Anything else is a query for DataFusion. Names may be quoted with backticks or double
//! quotes; a trailing comma in a column list and `--` / `/* */` comments are allowed.

use crate::types::ColumnType;

/// A parsed catalog statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Ddl {
    CreateTable {
        name: Vec<String>,
        if_not_exists: bool,
        columns: Vec<(String, ColumnType, Option<String>)>,
    },
    CreateDatabase {
        name: String,
        if_not_exists: bool,
    },
    CreateSchema {
        name: Vec<String>,
        if_not_exists: bool,
    },
    Drop {
        kind: DropKind,
        name: Vec<String>,
        if_exists: bool,
    },
    Describe {
        name: Vec<String>,
    },
    AlterTable {
        name: Vec<String>,
        change: AlterColumn,
    },
    ShowTables,
    ShowDatabases,
    ShowSchemas,
}

/// What an `ALTER TABLE` changes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum AlterColumn {
    Add {
        column: String,
        data_type: ColumnType,
        comment: Option<String>,
        if_not_exists: bool,
    },
    Drop {
        column: String,
        if_exists: bool,
    },
    Rename {
        from: String,
        to: String,
    },
    Comment {
        column: String,
        comment: Option<String>,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum DropKind {
    Table,
    Schema,
    Database,
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Token {
    Word(String),
    Quoted(String),
    Str(String),
    Punct(char),
}

/// A DDL syntax error with its byte offset in the statement.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct DdlError {
    pub(crate) message: String,
    pub(crate) offset: usize,
}

fn tokenize(sql: &str) -> Result<Vec<(Token, usize)>, DdlError> {
    let bytes = sql.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let err = |message: &str, offset| DdlError {
        message: message.to_owned(),
        offset,
    };
    while i < bytes.len() {
        let c = bytes[i];
        if c.is_ascii_whitespace() {
            i += 1;
        } else if let Some(end) = super::lex::skip_comment(sql, i).map_err(|m| err(m, i))? {
            i = end;
        } else if c.is_ascii_alphanumeric() || c == b'_' {
            let start = i;
            while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
                i += 1;
            }
            out.push((Token::Word(sql[start..i].to_owned()), start));
        } else if c == b'`' || c == b'"' || c == b'\'' {
            let start = i;
            let (text, end) =
                super::lex::read_quoted(sql, start, false).map_err(|m| err(m, start))?;
            i = end;
            out.push((
                if c == b'\'' {
                    Token::Str(text)
                } else {
                    Token::Quoted(text)
                },
                start,
            ));
        } else if matches!(c, b'(' | b')' | b',' | b'.' | b';') {
            out.push((Token::Punct(c as char), i));
            i += 1;
        } else {
            return Err(err(&format!("unexpected character {:?}", c as char), i));
        }
    }
    Ok(out)
}

struct Parser {
    tokens: Vec<(Token, usize)>,
    pos: usize,
    end: usize,
}

impl Parser {
    fn offset(&self) -> usize {
        self.tokens.get(self.pos).map_or(self.end, |t| t.1)
    }

    fn error(&self, message: impl Into<String>) -> DdlError {
        DdlError {
            message: message.into(),
            offset: self.offset(),
        }
    }

    fn keyword(&mut self, word: &str) -> bool {
        match self.tokens.get(self.pos) {
            Some((Token::Word(w), _)) if w.eq_ignore_ascii_case(word) => {
                self.pos += 1;
                true
            }
            _ => false,
        }
    }

    fn expect_keyword(&mut self, word: &str) -> Result<(), DdlError> {
        if self.keyword(word) {
            Ok(())
        } else {
            Err(self.error(format!("expected {word}")))
        }
    }

    fn punct(&mut self, p: char) -> bool {
        if self.tokens.get(self.pos).map(|t| &t.0) == Some(&Token::Punct(p)) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    fn ident(&mut self) -> Result<String, DdlError> {
        match self.tokens.get(self.pos) {
            Some((Token::Word(w), _)) => {
                let w = w.clone();
                self.pos += 1;
                Ok(w)
            }
            Some((Token::Quoted(q), _)) => {
                let q = q.clone();
                self.pos += 1;
                Ok(q)
            }
            _ => Err(self.error("expected a name")),
        }
    }

    fn name(&mut self) -> Result<Vec<String>, DdlError> {
        let mut parts = vec![self.ident()?];
        while self.punct('.') {
            parts.push(self.ident()?);
        }
        if parts.len() > 3 {
            return Err(self.error("a name has at most three parts: database.schema.table"));
        }
        Ok(parts)
    }

    fn column_type(&mut self) -> Result<ColumnType, DdlError> {
        let offset = self.offset();
        self.ident()?
            .parse()
            .map_err(|e: crate::types::UnknownTypeError| DdlError {
                message: e.to_string(),
                offset,
            })
    }

    fn comment(&mut self) -> Result<String, DdlError> {
        match self.tokens.get(self.pos) {
            Some((Token::Str(s), _)) => {
                let s = s.clone();
                self.pos += 1;
                Ok(s)
            }
            _ => Err(self.error("expected a quoted comment")),
        }
    }

    /// The change of an `ALTER TABLE name`, after the name.
    fn alter_column(&mut self) -> Result<AlterColumn, DdlError> {
        if self.keyword("ADD") {
            self.keyword("COLUMN");
            let if_not_exists = self.if_not_exists()?;
            let column = self.ident()?;
            let data_type = self.column_type()?;
            let comment = match self.keyword("COMMENT") {
                true => Some(self.comment()?),
                false => None,
            };
            Ok(AlterColumn::Add {
                column,
                data_type,
                comment,
                if_not_exists,
            })
        } else if self.keyword("DROP") {
            self.keyword("COLUMN");
            let if_exists = self.if_exists()?;
            Ok(AlterColumn::Drop {
                column: self.ident()?,
                if_exists,
            })
        } else if self.keyword("RENAME") {
            self.expect_keyword("COLUMN")?;
            let from = self.ident()?;
            self.expect_keyword("TO")?;
            Ok(AlterColumn::Rename {
                from,
                to: self.ident()?,
            })
        } else if self.keyword("ALTER") {
            self.keyword("COLUMN");
            let column = self.ident()?;
            let comment = if self.keyword("SET") {
                self.expect_keyword("COMMENT")?;
                Some(self.comment()?)
            } else if self.keyword("DROP") {
                self.expect_keyword("COMMENT")?;
                None
            } else {
                return Err(self.error(
                    "expected SET COMMENT or DROP COMMENT (a column's type never changes: add a new column)",
                ));
            };
            Ok(AlterColumn::Comment { column, comment })
        } else {
            Err(self.error("expected ADD, DROP, RENAME COLUMN or ALTER COLUMN"))
        }
    }

    fn if_not_exists(&mut self) -> Result<bool, DdlError> {
        if self.keyword("IF") {
            self.expect_keyword("NOT")?;
            self.expect_keyword("EXISTS")?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn if_exists(&mut self) -> Result<bool, DdlError> {
        if self.keyword("IF") {
            self.expect_keyword("EXISTS")?;
            Ok(true)
        } else {
            Ok(false)
        }
    }

    fn finish(&mut self) -> Result<(), DdlError> {
        while self.punct(';') {}
        if self.pos < self.tokens.len() {
            Err(self.error("unexpected text after the statement"))
        } else {
            Ok(())
        }
    }
}

fn is_keyword(tokens: &[(Token, usize)], i: usize, word: &str) -> bool {
    matches!(tokens.get(i), Some((Token::Word(w), _)) if w.eq_ignore_ascii_case(word))
}

/// Parses `sql` as a catalog statement; `Ok(None)` when it is not one (a query).
pub(crate) fn parse(sql: &str) -> Result<Option<Ddl>, DdlError> {
    let Ok(tokens) = tokenize(sql) else {
        // Not our syntax; let the query parser report on it.
        return Ok(None);
    };
    let ours = (is_keyword(&tokens, 0, "CREATE")
        && (is_keyword(&tokens, 1, "TABLE")
            || is_keyword(&tokens, 1, "DATABASE")
            || is_keyword(&tokens, 1, "SCHEMA")))
        || (is_keyword(&tokens, 0, "DROP")
            && (is_keyword(&tokens, 1, "TABLE")
                || is_keyword(&tokens, 1, "DATABASE")
                || is_keyword(&tokens, 1, "SCHEMA")))
        || (is_keyword(&tokens, 0, "ALTER") && is_keyword(&tokens, 1, "TABLE"))
        || is_keyword(&tokens, 0, "DESCRIBE")
        || is_keyword(&tokens, 0, "DESC")
        || (is_keyword(&tokens, 0, "SHOW")
            && (is_keyword(&tokens, 1, "TABLES")
                || is_keyword(&tokens, 1, "DATABASES")
                || is_keyword(&tokens, 1, "SCHEMAS")));
    if !ours {
        return Ok(None);
    }
    let mut p = Parser {
        tokens,
        pos: 0,
        end: sql.len(),
    };
    let ddl = if p.keyword("CREATE") {
        if p.keyword("TABLE") {
            let if_not_exists = p.if_not_exists()?;
            let name = p.name()?;
            if !p.punct('(') {
                return Err(p.error("expected '(' and a column list"));
            }
            let mut columns = Vec::new();
            loop {
                if p.punct(')') {
                    break;
                }
                let column = p.ident()?;
                let type_offset = p.offset();
                let type_name = p.ident()?;
                let column_type: ColumnType =
                    type_name
                        .parse()
                        .map_err(|e: crate::types::UnknownTypeError| DdlError {
                            message: e.to_string(),
                            offset: type_offset,
                        })?;
                let mut comment = None;
                if p.keyword("COMMENT") {
                    match p.tokens.get(p.pos) {
                        Some((Token::Str(s), _)) => {
                            comment = Some(s.clone());
                            p.pos += 1;
                        }
                        _ => return Err(p.error("expected a quoted comment")),
                    }
                }
                columns.push((column, column_type, comment));
                if p.punct(',') {
                    continue;
                }
                if p.punct(')') {
                    break;
                }
                return Err(p.error("expected ',' or ')'"));
            }
            if columns.is_empty() {
                return Err(p.error("a table needs at least one column"));
            }
            Ddl::CreateTable {
                name,
                if_not_exists,
                columns,
            }
        } else if p.keyword("DATABASE") {
            let if_not_exists = p.if_not_exists()?;
            Ddl::CreateDatabase {
                name: p.ident()?,
                if_not_exists,
            }
        } else {
            p.expect_keyword("SCHEMA")?;
            let if_not_exists = p.if_not_exists()?;
            let name = p.name()?;
            if name.len() > 2 {
                return Err(p.error("a schema name has at most two parts: database.schema"));
            }
            Ddl::CreateSchema {
                name,
                if_not_exists,
            }
        }
    } else if p.keyword("DROP") {
        let kind = if p.keyword("TABLE") {
            DropKind::Table
        } else if p.keyword("SCHEMA") {
            DropKind::Schema
        } else {
            p.expect_keyword("DATABASE")?;
            DropKind::Database
        };
        let if_exists = p.if_exists()?;
        Ddl::Drop {
            kind,
            name: p.name()?,
            if_exists,
        }
    } else if p.keyword("ALTER") {
        p.expect_keyword("TABLE")?;
        let name = p.name()?;
        Ddl::AlterTable {
            name,
            change: p.alter_column()?,
        }
    } else if p.keyword("DESCRIBE") || p.keyword("DESC") {
        p.keyword("TABLE");
        Ddl::Describe { name: p.name()? }
    } else {
        p.expect_keyword("SHOW")?;
        if p.keyword("TABLES") {
            Ddl::ShowTables
        } else if p.keyword("DATABASES") {
            Ddl::ShowDatabases
        } else {
            p.expect_keyword("SCHEMAS")?;
            Ddl::ShowSchemas
        }
    };
    p.finish()?;
    Ok(Some(ddl))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn create_table_with_sluice_types() {
        let ddl = parse(
            "CREATE TABLE IF NOT EXISTS scopedb.public.`events` (\n  time timestamp COMMENT 'when',\n  var object, -- payload\n  tags array, x any, d interval, b binary, u uint,\n)",
        )
        .unwrap()
        .unwrap();
        match ddl {
            Ddl::CreateTable {
                name,
                if_not_exists,
                columns,
            } => {
                assert_eq!(name, vec!["scopedb", "public", "events"]);
                assert!(if_not_exists);
                assert_eq!(columns.len(), 7);
                assert_eq!(
                    columns[0],
                    ("time".into(), ColumnType::Timestamp, Some("when".into()))
                );
                assert_eq!(columns[2].1, ColumnType::Array);
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn alter_table_statements() {
        let add = parse("ALTER TABLE db.s.t ADD COLUMN IF NOT EXISTS tags array COMMENT 'labels'");
        assert_eq!(
            add.unwrap().unwrap(),
            Ddl::AlterTable {
                name: vec!["db".into(), "s".into(), "t".into()],
                change: AlterColumn::Add {
                    column: "tags".into(),
                    data_type: ColumnType::Array,
                    comment: Some("labels".into()),
                    if_not_exists: true,
                },
            }
        );
        assert_eq!(
            parse("alter table t drop if exists x;").unwrap().unwrap(),
            Ddl::AlterTable {
                name: vec!["t".into()],
                change: AlterColumn::Drop {
                    column: "x".into(),
                    if_exists: true,
                },
            }
        );
        assert_eq!(
            parse("ALTER TABLE t RENAME COLUMN a TO `b`")
                .unwrap()
                .unwrap(),
            Ddl::AlterTable {
                name: vec!["t".into()],
                change: AlterColumn::Rename {
                    from: "a".into(),
                    to: "b".into(),
                },
            }
        );
        assert_eq!(
            parse("ALTER TABLE t ALTER COLUMN a DROP COMMENT")
                .unwrap()
                .unwrap(),
            Ddl::AlterTable {
                name: vec!["t".into()],
                change: AlterColumn::Comment {
                    column: "a".into(),
                    comment: None,
                },
            }
        );
        let e = parse("ALTER TABLE t ALTER COLUMN a TYPE string").unwrap_err();
        assert!(e.message.contains("never changes"), "{e:?}");
        let e = parse("ALTER TABLE t ADD c varchar").unwrap_err();
        assert!(e.message.contains("unknown column type"), "{e:?}");
        assert!(parse("ALTER TABLE t ADD c int extra").is_err());
    }

    #[test]
    fn errors_point_at_the_problem() {
        let e = parse("CREATE TABLE t (a varchar)").unwrap_err();
        assert_eq!(e.offset, 18);
        assert!(e.message.contains("unknown column type"));
        assert!(parse("SELECT 1").unwrap().is_none());
        assert!(parse("DROP TABLE IF EXISTS a.b.c").unwrap().is_some());
        assert!(parse("SHOW TABLES").unwrap().is_some());
    }
}
