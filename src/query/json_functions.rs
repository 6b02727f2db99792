//! The JSON functions (`json_get_str` and the rest, from `datafusion-functions-json`), as the
//! engine registers them.
//!
//! Those functions ask DataFusion to evaluate them at the scan, below filters
//! (`ScalarUDFImpl::placement` answers `MoveTowardsLeafNodes` for `f(column, literal...)`),
//! so `... WHERE status = 500 GROUP BY json_get_str(var, 'region')` parsed the JSON of every
//! row, five times the rows the filter keeps (`cargo bench --bench queries`: 139 ms). Wrapped
//! here, they keep the placement of any other function and run on the rows that pass.

use std::sync::Arc;

use datafusion::error::Result;
use datafusion::logical_expr::ScalarUDF;
use datafusion::prelude::SessionContext;

use super::wrapped_udf::{AsIs, Wrapped};

/// Registers the JSON functions (and their operator rewrites) on `ctx`, each evaluated in
/// place.
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
            invoke: AsIs,
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
}
