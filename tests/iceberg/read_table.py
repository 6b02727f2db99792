"""Reads a sluice table through sluice's Iceberg REST catalog with real readers and prints
what they saw as one JSON document, for tests/it/iceberg.rs to compare with what was
ingested. The readers (installed by tests/run.sh, pinned): pyiceberg (the catalog, the
metadata, the files it plans, its rows), and with --readers also Daft (on the pyiceberg
table), Polars (`scan_iceberg` on the pyiceberg table, Polars' own Parquet reader) and
DuckDB (its iceberg, avro and httpfs extensions from PyPI, loaded from the installed
packages, never downloaded; it ATTACHes the REST catalog itself with the key as its
bearer token).

Usage: read_table.py CATALOG_URI NAMESPACE TABLE [--token KEY] [--warehouse NAME]
       [--s3-key ID SECRET] [--readers daft,polars,duckdb] [--time-filter INSTANT]
       [--time-after INSTANT]

Each reader's rows come as lists of JSON objects, ordered by the first column: integers as
they are, timestamps and durations as integers in the unit the reader gave (named in its
`types`), binary as base64, text as text. A reader that fails gives `{"error": message}`.
"""

import argparse
import base64
import json
import os
import sys


def cell(value):
    """One Arrow value as JSON: bytes as base64, timestamps as nanoseconds."""
    import datetime
    import decimal

    if value is None:
        return None
    if isinstance(value, (bytes, bytearray, memoryview)):
        return {"base64": base64.b64encode(bytes(value)).decode()}
    if isinstance(value, decimal.Decimal):
        return {"decimal": str(value)}
    if isinstance(value, (datetime.datetime, datetime.timedelta)):
        raise TypeError(f"unexpected Python {type(value).__name__}: compare raw integers")
    return value


def rows_of(arrow):
    """An Arrow table's rows (timestamps and durations as their integers), ordered by the
    first column, and its column types."""
    import pyarrow as pa
    import pyarrow.compute as pc

    types = {f.name: str(f.type) for f in arrow.schema}
    columns = {}
    for name in arrow.column_names:
        col = arrow.column(name)
        if pa.types.is_timestamp(col.type) or pa.types.is_duration(col.type):
            col = pc.cast(col, pa.int64())
        columns[name] = col.to_pylist()
    rows = [
        {name: cell(columns[name][i]) for name in arrow.column_names}
        for i in range(arrow.num_rows)
    ]
    if arrow.column_names:
        key = arrow.column_names[0]
        rows.sort(key=lambda r: (r[key] is None, r[key]))
    return {"types": types, "rows": rows}


def bound_of(bounds, field_id):
    """A `long`-encoded bound (Iceberg's single-value serialization) of `field_id` as an
    integer, or None when the map or the entry is missing."""
    raw = (bounds or {}).get(field_id)
    return None if raw is None else int.from_bytes(raw, "little", signed=True)


def polars_filtered_count(table, instant):
    """Polars: the rows with `t` at or before `instant` (ISO 8601), a filter Polars pushes
    into its scan and prunes files with by the manifests' statistics."""
    import datetime

    import polars as pl

    at = datetime.datetime.fromisoformat(instant)
    return pl.scan_iceberg(table).filter(pl.col("t") <= at).select(pl.len()).collect().item()


def attempt(read):
    try:
        return read()
    except Exception as e:  # a reader's refusal is a result to report, not a crash
        return {"error": f"{type(e).__name__}: {e}"}


def duckdb_rows(args, namespace, table_name):
    """DuckDB: ATTACH the REST catalog (warehouse, bearer token, S3 secret), read the table."""
    import duckdb
    import glob

    # The extension packages (duckdb-ext-*) install their files under site-packages.
    found = [
        p
        for d in sys.path
        for p in glob.glob(os.path.join(d, "duckdb_ext", "extensions"))
        if os.path.isdir(p)
    ]
    if not found:
        raise RuntimeError("the duckdb-ext-* packages are not installed")
    con = duckdb.connect(
        config={
            "extension_directory": found[0],
            "autoinstall_known_extensions": False,
            "autoload_known_extensions": False,
        }
    )
    for ext in ("avro", "httpfs", "iceberg"):
        con.execute(f"LOAD {ext}")
    if args.token:
        con.execute("CREATE SECRET sluice_key (TYPE iceberg, TOKEN ?)", [args.token])
        auth = "SECRET sluice_key"
    else:
        auth = "AUTHORIZATION_TYPE 'none'"
    if args.s3_key:
        endpoint = os.environ.get("AWS_ENDPOINT", "")
        con.execute(
            "CREATE SECRET sluice_s3 (TYPE s3, KEY_ID ?, SECRET ?, REGION ?, ENDPOINT ?, "
            "URL_STYLE 'path', USE_SSL ?)",
            [
                args.s3_key[0],
                args.s3_key[1],
                os.environ.get("AWS_REGION", "us-east-1"),
                endpoint.split("://", 1)[-1],
                endpoint.startswith("https://"),
            ],
        )
    warehouse = (args.warehouse or "").replace("'", "''")
    endpoint = args.uri.replace("'", "''")
    con.execute(f"ATTACH '{warehouse}' AS sl (TYPE iceberg, ENDPOINT '{endpoint}', {auth})")
    quoted = f'sl."{namespace}"."{table_name}"'
    out = rows_of(con.execute(f"SELECT * FROM {quoted}").fetch_arrow_table())
    if args.time_filter:
        out["filtered_count"] = con.execute(
            f"SELECT count(*) FROM {quoted} WHERE t <= ?::TIMESTAMPTZ", [args.time_filter]
        ).fetchone()[0]
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("uri")
    p.add_argument("namespace")
    p.add_argument("table")
    p.add_argument("--token")
    p.add_argument("--warehouse")
    p.add_argument("--s3-key", nargs=2)
    p.add_argument("--readers", default="")
    # An instant (ISO 8601, UTC): pyiceberg, Polars and DuckDB also count the rows with `t`
    # at or before it, a filter they prune files with by the manifests' statistics of `t`.
    p.add_argument("--time-filter")
    # An instant (ISO 8601, UTC, microseconds): pyiceberg also counts the rows with `t` after
    # it (pyiceberg prunes by the manifests' bounds, then compares the files' own values).
    p.add_argument("--time-after")
    args = p.parse_args()
    readers = [r for r in args.readers.split(",") if r]

    from pyiceberg.catalog.rest import RestCatalog

    props = {"uri": args.uri}
    if args.token:
        props["token"] = args.token
    if args.warehouse is not None:
        props["warehouse"] = args.warehouse
    if args.s3_key:
        props["s3.access-key-id"], props["s3.secret-access-key"] = args.s3_key
    catalog = RestCatalog("sluice", **props)
    out = {}
    out["namespaces"] = [list(n) for n in catalog.list_namespaces()]
    out["child_namespaces"] = [list(n) for n in catalog.list_namespaces(tuple(args.namespace.split(".")[:1]))]
    out["tables"] = [list(t) for t in catalog.list_tables(args.namespace)]
    table = catalog.load_table(f"{args.namespace}.{args.table}")
    out["format_version"] = table.metadata.format_version
    out["metadata_location"] = table.metadata_location
    out["iceberg_types"] = {f.name: str(f.field_type) for f in table.schema().fields}
    out["current_schema_id"] = table.metadata.current_schema_id
    out["schemas"] = {
        str(schema_id): [[f.field_id, f.name, str(f.field_type)] for f in schema.fields]
        for schema_id, schema in table.schemas().items()
    }
    snapshot = table.current_snapshot()
    out["snapshot"] = None if snapshot is None else snapshot.snapshot_id
    out["snapshots"] = [s.snapshot_id for s in table.snapshots()]
    # Every listed snapshot reads (time travel): its row count.
    out["snapshot_rows"] = {
        str(s.snapshot_id): table.scan(snapshot_id=s.snapshot_id).to_arrow().num_rows
        for s in table.snapshots()
    }
    scan = table.scan()
    tasks = list(scan.plan_files())
    out["files"] = sorted(t.file.file_path for t in tasks)
    # The manifests' bounds of `t` (the lower and upper of each planned file, as the integers
    # of the view's unit; null where a file has none), when the table has a `t`.
    try:
        t_id = table.schema().find_field("t").field_id
    except ValueError:
        t_id = None
    if t_id is not None:
        bounds = [
            [bound_of(t.file.lower_bounds, t_id), bound_of(t.file.upper_bounds, t_id)]
            for t in tasks
        ]
        out["t_bounds"] = sorted(bounds, key=lambda b: (b[0] is None, b[0] or 0, b[1] or 0))
    seen = rows_of(scan.to_arrow())
    out["arrow_types"] = seen["types"]
    out["rows"] = seen["rows"]
    if args.time_filter:
        from pyiceberg.expressions import LessThanOrEqual

        out["filtered_count"] = attempt(
            lambda: table.scan(row_filter=LessThanOrEqual("t", args.time_filter)).to_arrow().num_rows
        )
    if args.time_after:
        from pyiceberg.expressions import GreaterThan

        out["after_count"] = attempt(
            lambda: table.scan(row_filter=GreaterThan("t", args.time_after)).to_arrow().num_rows
        )
    out["readers"] = {}
    if "daft" in readers:
        import daft

        out["readers"]["daft"] = attempt(lambda: rows_of(daft.read_iceberg(table).to_arrow()))
    if "polars" in readers:
        import polars as pl

        out["readers"]["polars"] = attempt(lambda: rows_of(pl.scan_iceberg(table).collect().to_arrow()))
        if args.time_filter and "error" not in out["readers"]["polars"]:
            out["readers"]["polars"]["filtered_count"] = attempt(
                lambda: polars_filtered_count(table, args.time_filter)
            )
    if "duckdb" in readers:
        out["readers"]["duckdb"] = attempt(lambda: duckdb_rows(args, args.namespace, args.table))
    json.dump(out, sys.stdout)


if __name__ == "__main__":
    main()
    # Leave without finalizing the interpreter: a reader's native worker threads (pyarrow's,
    # pyiceberg's pool) may still hold or release the GIL then, which CPython answers with
    # a fatal error ("PyGILState_Release: thread state ... must be current", seen once in a
    # full run) after everything was read and printed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
