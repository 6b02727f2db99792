//! The JSON functions (`json_get_str` and the rest, from `datafusion-functions-json`), as the
//! engine registers them.
//!
//! Those functions ask DataFusion to evaluate them at the scan, below filters
//! (`ScalarUDFImpl::placement` answers `MoveTowardsLeafNodes` for `f(column, literal...)`),
//! so `... WHERE status = 500 GROUP BY json_get_str(var, 'region')` parsed the JSON of every
//! row, five times the rows the filter keeps (`cargo bench --bench queries`: 139 ms). Wrapped
//! here, they keep the placement of any other function and run on the rows that pass, and
//! once per distinct text in a batch where the texts repeat ([`OncePerValue`]).

use std::sync::Arc;

use datafusion::error::Result;
use datafusion::logical_expr::ScalarUDF;
use datafusion::prelude::SessionContext;

use super::wrapped_udf::{OncePerValue, Wrapped};

/// Registers the JSON functions on `ctx`, each evaluated in place. (The crate's rewrites of
/// `->`, `->>` and its other operators call its own functions, unwrapped: those keep the
/// crate's placement and run row by row.)
pub(super) fn register(ctx: &mut SessionContext) -> Result<()> {
    datafusion_functions_json::register_all(ctx)?;
    let json: Vec<Arc<ScalarUDF>> = ctx
        .state()
        .scalar_functions()
        .values()
        .filter(|f| f.name().starts_with("json_"))
        .cloned()
        .collect();
    for inner in json {
        ctx.register_udf(ScalarUDF::new_from_impl(Wrapped {
            inner,
            invoke: OncePerValue,
        }));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::{Int64Array, RecordBatch, StringArray};
    use arrow_schema::{DataType, Field, Schema};
    use datafusion::datasource::MemTable;

    #[tokio::test]
    async fn extraction_runs_after_the_filter() {
        let schema = Arc::new(Schema::new(vec![
            Field::new("status", DataType::Int64, true),
            Field::new("var", DataType::Utf8, true),
        ]));
        let batch = RecordBatch::try_new(
            schema.clone(),
            vec![
                Arc::new(Int64Array::from(vec![500, 200, 500])),
                Arc::new(StringArray::from(vec![
                    r#"{"region":"apac"}"#,
                    r#"{"region":"emea"}"#,
                    r#"{"region":"apac"}"#,
                ])),
            ],
        )
        .unwrap();
        let mut ctx = SessionContext::new();
        register(&mut ctx).unwrap();
        let table = MemTable::try_new(schema, vec![vec![batch]]).unwrap();
        ctx.register_table("events", Arc::new(table)).unwrap();
        let sql = "SELECT json_get_str(var, 'region') AS region, count(*) AS n FROM events \
                   WHERE status = 500 GROUP BY 1";
        let plan = ctx.sql(&format!("EXPLAIN {sql}")).await.unwrap();
        let text = arrow_cast::pretty::pretty_format_batches(&plan.collect().await.unwrap())
            .unwrap()
            .to_string();
        // Pushed to the scan, the call shows up as an extracted column below the filter.
        assert!(!text.contains("__datafusion_extracted"), "{text}");
        let rows = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let text = arrow_cast::pretty::pretty_format_batches(&rows)
            .unwrap()
            .to_string();
        assert!(text.contains("| apac   | 2 |"), "{text}");
    }

    /// Texts read as the views of a Parquet dictionary's values (evaluated once per value)
    /// answer as the same texts in a plain column (evaluated row by row), for functions
    /// that answer strings, integers, booleans, unions and lists.
    #[tokio::test]
    async fn repeated_texts_answer_as_each_row_would() {
        use arrow_array::{Array as _, ArrayRef, DictionaryArray, types::Int32Type};
        let texts = StringArray::from(vec![
            r#"{"region":"apac","attempt":1,"gateway":"credit_card"}"#,
            r#"{"region":"eu","list":[1,"two",{"three":3}]}"#,
            r#"{"attempt":3,"gateway":"credit_card","region":null}"#,
            "{}",
            "not json at all, long enough not to be inline",
        ]);
        let keys: Vec<Option<i32>> = (0..3000).map(|i| (i % 11 != 5).then_some(i % 5)).collect();
        let dictionary =
            DictionaryArray::<Int32Type>::try_new(keys.into_iter().collect(), Arc::new(texts))
                .unwrap();
        let views: ArrayRef = arrow_cast::cast(&dictionary, &DataType::Utf8View).unwrap();
        let plain: ArrayRef = arrow_cast::cast(&dictionary, &DataType::Utf8).unwrap();
        let schema = Arc::new(Schema::new(vec![
            Field::new("v", DataType::Utf8View, true),
            Field::new("u", DataType::Utf8, true),
        ]));
        let batch = RecordBatch::try_new(schema.clone(), vec![views, plain]).unwrap();
        let mut ctx = SessionContext::new();
        register(&mut ctx).unwrap();
        let table = MemTable::try_new(schema, vec![vec![batch]]).unwrap();
        ctx.register_table("t", Arc::new(table)).unwrap();
        let sql = "SELECT json_get_str(v, 'region'), json_get_str(u, 'region'), \
                   json_get_int(v, 'attempt'), json_get_int(u, 'attempt'), \
                   json_length(v), json_length(u), json_contains(v, 'region'), \
                   json_contains(u, 'region'), json_get(v, 'attempt'), json_get(u, 'attempt'), \
                   json_object_keys(v), json_object_keys(u), \
                   json_get_array(v, 'list'), json_get_array(u, 'list') FROM t";
        let batches = ctx.sql(sql).await.unwrap().collect().await.unwrap();
        let rows: usize = batches.iter().map(|b| b.num_rows()).sum();
        assert_eq!(rows, 3000);
        let mut seen = 0;
        for batch in &batches {
            for pair in batch.columns().chunks(2) {
                let text = |a: &ArrayRef| {
                    let options = arrow_cast::display::FormatOptions::default();
                    let format = arrow_cast::display::ArrayFormatter::try_new(a, &options).unwrap();
                    (0..a.len())
                        .map(|i| (a.is_valid(i), format.value(i).to_string()))
                        .collect::<Vec<_>>()
                };
                assert_eq!(text(&pair[0]), text(&pair[1]));
                seen += pair[0].len() - pair[0].null_count();
            }
        }
        // Not all null: the functions found what the texts hold.
        assert!(seen > 3000, "{seen}");
        // That the function runs once per distinct text: `wrapped_udf`'s tests.
    }
}
