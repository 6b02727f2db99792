"""Reads a sluice table through sluice's Iceberg REST catalog with real readers (pyiceberg,
and Daft through pyiceberg) and prints what they saw as one JSON document, for
tests/it/iceberg.rs to compare with what was ingested.

Usage: read_table.py CATALOG_URI NAMESPACE TABLE [--token KEY] [--s3-key ID SECRET] [--daft]
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
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode()}
    if isinstance(value, decimal.Decimal):
        return {"decimal": str(value)}
    if isinstance(value, (datetime.datetime, datetime.timedelta)):
        raise TypeError(f"unexpected Python {type(value).__name__}: compare raw integers")
    return value


def main():
    p = argparse.ArgumentParser()
    p.add_argument("uri")
    p.add_argument("namespace")
    p.add_argument("table")
    p.add_argument("--token")
    p.add_argument("--s3-key", nargs=2)
    p.add_argument("--daft", action="store_true")
    args = p.parse_args()

    import pyarrow as pa
    import pyarrow.compute as pc
    from pyiceberg.catalog.rest import RestCatalog

    props = {"uri": args.uri}
    if args.token:
        props["token"] = args.token
    if args.s3_key:
        props["s3.access-key-id"], props["s3.secret-access-key"] = args.s3_key
    catalog = RestCatalog("sluice", **props)
    out = {}
    out["namespaces"] = [list(n) for n in catalog.list_namespaces()]
    out["child_namespaces"] = [list(n) for n in catalog.list_namespaces(tuple(args.namespace.split(".")[:1]))]
    out["tables"] = [list(t) for t in catalog.list_tables(args.namespace)]
    table = catalog.load_table(f"{args.namespace}.{args.table}")
    out["format_version"] = table.metadata.format_version
    out["iceberg_types"] = {f.name: str(f.field_type) for f in table.schema().fields}
    snapshot = table.current_snapshot()
    out["snapshot"] = None if snapshot is None else snapshot.snapshot_id
    out["snapshots"] = [s.snapshot_id for s in table.snapshots()]
    scan = table.scan()
    out["files"] = sorted(t.file.file_path for t in scan.plan_files())
    arrow = scan.to_arrow()
    out["arrow_types"] = {f.name: str(f.type) for f in arrow.schema}
    rows = []
    # Timestamps and durations as their integer nanoseconds: exact, no float or tz rendering.
    columns = {}
    for name in arrow.column_names:
        col = arrow.column(name)
        if pa.types.is_timestamp(col.type) or pa.types.is_duration(col.type):
            col = pc.cast(col, pa.int64())
        columns[name] = col.to_pylist()
    for i in range(arrow.num_rows):
        rows.append({name: cell(columns[name][i]) for name in arrow.column_names})
    out["rows"] = rows
    if args.daft:
        import daft

        df = daft.read_iceberg(table)
        agg = df.agg(daft.col("i").count().alias("count"), daft.col("i").sum().alias("sum")).to_pydict()
        out["daft"] = {"count": agg["count"][0], "sum": agg["sum"][0]}
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
