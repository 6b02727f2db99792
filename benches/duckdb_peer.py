"""The DuckDB side of the end-to-end benches (benches/ingest.rs, benches/queries.rs).

  duckdb_peer.py convert NDJSON PARQUET   -- converts the file with explicit column types
  duckdb_peer.py query                    -- runs the queries in the JSON spec on stdin

Answers one JSON object on stdout. DuckDB uses every core of the machine (its default).
"""

import json
import os
import resource
import statistics
import sys
import time

import duckdb

# The events table's columns as DuckDB reads them. DuckDB checks less than sluice: `trace`
# (base64) and `elapsed` (ISO 8601 duration: DuckDB's read_json does not parse `PT1.5S`) stay
# unchecked strings, and `var` is any JSON value, not only an object.
COLUMNS = {
    "time": "TIMESTAMPTZ",
    "service": "VARCHAR",
    "name": "VARCHAR",
    "message": "VARCHAR",
    "status": "BIGINT",
    "latency": "DOUBLE",
    "ok": "BOOLEAN",
    "trace": "VARCHAR",
    "elapsed": "VARCHAR",
    "var": "JSON",
}


def sql_string(s):
    return "'" + s.replace("'", "''") + "'"


def cpu_seconds():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def convert(src, dst):
    con = duckdb.connect()
    columns = "{" + ", ".join(f"{sql_string(k)}: {sql_string(v)}" for k, v in COLUMNS.items()) + "}"
    cpu_before = cpu_seconds()
    started = time.perf_counter()
    con.execute(
        f"COPY (SELECT * FROM read_json({sql_string(src)}, format='newline_delimited', "
        f"columns={columns})) TO {sql_string(dst)} (FORMAT parquet, COMPRESSION zstd)"
    )
    seconds = time.perf_counter() - started
    rows = con.execute(f"SELECT count(*) FROM read_parquet({sql_string(dst)})").fetchone()[0]
    return {
        "seconds": seconds,
        "rows": rows,
        "parquet_bytes": os.path.getsize(dst),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "cpu_seconds": cpu_seconds() - cpu_before,
        "threads": con.execute("SELECT current_setting('threads')").fetchone()[0],
    }


def cell(v):
    """A result cell as text, the way sluice's statements API answers it."""
    if v is None:
        return None
    if isinstance(v, float):
        return repr(v)
    return str(v)


def query(spec):
    con = duckdb.connect()
    files = "[" + ", ".join(sql_string(f) for f in spec["files"]) + "]"
    con.execute(f"CREATE VIEW events AS SELECT * FROM read_parquet({files})")
    out = {}
    for q in spec["queries"]:
        con.execute(q["sql"]).fetchall()  # warm-up, as the sluice side gets
        times = []
        rows = None
        for _ in range(spec["repeat"]):
            started = time.perf_counter()
            rows = con.execute(q["sql"]).fetchall()
            times.append(time.perf_counter() - started)
        out[q["name"]] = {
            "median_ms": statistics.median(times) * 1e3,
            "rows": [[cell(v) for v in r] for r in rows],
        }
    return out


def main():
    if sys.argv[1] == "convert":
        print(json.dumps(convert(sys.argv[2], sys.argv[3])))
    elif sys.argv[1] == "query":
        print(json.dumps(query(json.load(sys.stdin))))
    else:
        raise SystemExit(f"unknown command {sys.argv[1]}")


if __name__ == "__main__":
    main()
