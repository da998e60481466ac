"""Analysts' SQL, made safe to run: parsed (not pattern-matched), resolved to liverl's
tables and a list of plain functions, scoped to the caller's tenant, and bounded.

What a query may do:
- one SELECT (WITH, UNION, joins and subqueries included) over liverl's own tables; no
  other database (`system.*`), no table function (`file`, `url`, `s3`, `remote`,
  `cluster`, `executable`, `input`, `numbers`...), no dictionary, no SETTINGS or FORMAT
  of its own (the API chooses the format and imposes the limits), no INTO OUTFILE;
- every function it calls is on `ALLOWED_FUNCTIONS`: a query that cannot be resolved
  fully to allowed tables and functions is refused, naming what was refused.

What a tenant key sees: in every table only its own tenant's rows (each table reference
becomes a subquery filtered on the tenant, wherever it appears); of `policy_versions`
(versions, lineage and states, no tenant column) every row without its `metrics`
column (training figures pooled over tenants); of `dead_letters` only rows stamped with
its tenant: letters whose tenant is unknown are for admin keys only.

The limits (`LIMITS`) ride on the query itself, so they bind on chdb, where a slow query
holds the sink's only session, and on a server alike. On a server, a deployment should
also give the sink a read-only ClickHouse user with row policies per tenant
(`docs/security.md`).
"""

from __future__ import annotations

import sqlglot
from sqlglot import exp
from sqlglot.errors import SqlglotError

DATABASE = "liverl"
TENANT_TABLES = {"feedback_events", "trajectories", "samples", "requests", "dead_letters", "version_hourly"}
# Tables without a tenant column, and the columns a tenant key may read of them.
SHARED_TABLES = {"policy_versions": "event_id, version, parent, created_at, updated_at, state, content_hash",
                 "capacity_events": "*"}

# Seconds, rows and bytes per query: chdb runs one query at a time, so an analyst's slow
# query would stall the sink's inserts for as long as it ran.
LIMITS = {"max_execution_time": 5, "max_result_rows": 100_000, "result_overflow_mode": "'throw'",
          "max_memory_usage": 1 << 30, "max_rows_to_read": 50_000_000, "readonly": 2}

# sqlglot's own names for the functions it types, and ClickHouse's for those it does not.
ALLOWED_FUNCTIONS = {name.lower() for name in """
    count sum avg min max any_value approx_distinct count_if quantile corr arg_max arg_min
    round floor ceil abs sqrt exp ln log power greatest least if coalesce nullif case
    timestamp_trunc datediff date_add date_sub time_to_str date_trunc length lower upper
    substring concat str_position starts_with ends_with trim split regexp_like cast try_cast
    json_extract_scalar json_extract explode array_contains struct row_number rank
    anyLast uniqExact quantiles quantileExact stddevPop stddevSamp varPop varSamp covarPop
    groupArray groupUniqArray topK sumIf avgIf minIf maxIf uniqIf countIf multiIf isNull
    isNotNull assumeNotNull toStartOfFiveMinutes toStartOfInterval toDate toDateTime
    toDateTime64 toHour toYYYYMM toYYYYMMDD toUnixTimestamp now today yesterday
    toIntervalHour toIntervalMinute toIntervalDay addHours subtractHours positionCaseInsensitive
    replaceAll extract toString toFloat64 toInt64 toUInt64 toUInt32 toInt32 toUInt8
    toDecimal64 JSONExtractFloat JSONExtractInt JSONExtractBool JSONHas JSONLength
    visitParamExtractString arrayElement tupleElement empty notEmpty lagInFrame leadInFrame
    intDiv modulo plus minus multiply divide negate equals notEquals exp10 sign and or not xor array
""".split()}


class RefusedQuery(ValueError):
    """A query that may not run, with what was refused."""


def function_name(node: exp.Func) -> str:
    if isinstance(node, (exp.Anonymous, exp.AnonymousAggFunc, exp.CombinedAggFunc,
                         exp.ParameterizedAgg, exp.CombinedParameterizedAgg)):
        return str(node.name)
    return node.sql_name()


def parse(sql: str) -> exp.Query:
    """The one statement in `sql`, if it is a query liverl can resolve."""
    try:
        sql.encode("utf-8")
    except UnicodeEncodeError as error:  # a lone surrogate: JSON carries it, no engine reads it
        raise RefusedQuery(f"the query is not UTF-8 text (character {error.start})") from None
    try:
        statements = [s for s in sqlglot.parse(sql, read="clickhouse") if s is not None]
    except SqlglotError as error:  # ParseError, and TokenError for text that does not tokenize
        raise RefusedQuery(f"cannot parse the query: {str(error).splitlines()[0]}") from None
    if len(statements) != 1:
        raise RefusedQuery(f"one statement per request, not {len(statements)}")
    statement = statements[0]
    if not isinstance(statement, exp.Query):
        raise RefusedQuery(f"only SELECT queries are allowed, not {statement.key.upper()}")
    return statement


def check(statement: exp.Query) -> None:
    """Refuse anything but liverl's tables and allowed functions, and any query option."""
    for node in statement.walk():
        if isinstance(node, exp.Select) and any(node.args.get(k) for k in ("settings", "format")):
            raise RefusedQuery("SETTINGS and FORMAT are set by the API, not by the query")
        if isinstance(node, (exp.Command, exp.Into, exp.Set)):
            raise RefusedQuery(f"{node.key.upper()} is not allowed in a query")
        if isinstance(node, exp.Func) and not isinstance(node, exp.Window):
            name = function_name(node)
            if name.lower() not in ALLOWED_FUNCTIONS:
                raise RefusedQuery(f"function {name!r} is not allowed")
    ctes = {cte.alias_or_name for cte in statement.find_all(exp.CTE)}
    for table in statement.find_all(exp.Table):
        if not isinstance(table.this, exp.Identifier):
            raise RefusedQuery(f"table function {table.this.sql(dialect='clickhouse')!r} is not allowed")
        if table.name in ctes and not table.db:
            continue
        if table.db not in ("", DATABASE) or table.name not in TENANT_TABLES | set(SHARED_TABLES):
            raise RefusedQuery(f"table {table.sql(dialect='clickhouse')!r} is not one of liverl's tables")


def scope_to_tenant(statement: exp.Query, tenant: str) -> exp.Query:
    """Every reference to a liverl table reads only the tenant's rows of it."""
    ctes = {cte.alias_or_name for cte in statement.find_all(exp.CTE)}
    literal = exp.Literal.string(tenant).sql(dialect="clickhouse")
    for table in list(statement.find_all(exp.Table)):
        if table.name in ctes and not table.db:
            continue
        parent = table.parent
        final = isinstance(parent, exp.Final)  # `t FINAL` stays on the table itself
        source = f"{DATABASE}.{table.name}{' FINAL' if final else ''}"
        if table.name in SHARED_TABLES:
            inner = f"SELECT {SHARED_TABLES[table.name]} FROM {source}"
        else:
            inner = f"SELECT * FROM {source} WHERE tenant = {literal}"
        scoped = exp.Subquery(this=sqlglot.parse_one(inner, read="clickhouse"),
                              alias=exp.TableAlias(this=exp.to_identifier(table.alias_or_name)))
        (parent if isinstance(parent, exp.Final) else table).replace(scoped)
    return statement


def prepare(sql: str, tenant: str | None) -> str:
    """The query to run for a caller: everything (admin, `tenant` None) or one tenant's
    rows; bounded by `LIMITS`. Raises `RefusedQuery`."""
    statement = parse(sql)
    check(statement)
    if tenant is not None:
        statement = scope_to_tenant(statement, tenant)
    limits = ", ".join(f"{k} = {v}" for k, v in LIMITS.items())
    return f"{statement.sql(dialect='clickhouse')} SETTINGS {limits}"
