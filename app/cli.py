"""The `liverl` command: run the stack, manage keys, query analytics, inspect dead letters."""

from __future__ import annotations

import json
import sys
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import NoReturn, cast

import httpx
import typer

from app.tables import console, print_rows
from liverl.settings import Settings
from sync.cli import app as delta_app
from sync.cli import sync_app

app = typer.Typer(help="liverl: online RL from production feedback.", no_args_is_help=True)
keys_app = typer.Typer(help="API keys: per-tenant write keys and admin keys.")
dlq_app = typer.Typer(help="The dead-letter topic: what could not be processed, and why.")
app.add_typer(keys_app, name="keys")
app.add_typer(dlq_app, name="dlq")
app.add_typer(delta_app, name="delta")
app.add_typer(sync_app, name="sync")


def settings_from(data_dir: Path | None) -> Settings:
    from liverl.manifest import running_settings

    return running_settings(data_dir)


DataDir = typer.Option(None, "--data-dir", envvar="LIVERL_DATA_DIR", help="State directory.")


def fail(message: str) -> NoReturn:
    console.print(f"[red]error:[/red] {message}")
    raise typer.Exit(1)


@app.command()
def up(data_dir: Path | None = DataDir, replicas: int | None = typer.Option(
        None, help="vLLM replicas to start.")) -> None:
    """Start the embedded stack and return when every component is healthy."""
    from app.stack import StackError
    from app.stack import up as stack_up

    settings = settings_from(data_dir)
    if replicas:
        settings.serving.replicas = replicas
    console.print("[bold]starting liverl[/bold]")
    try:
        stack_up(settings, say=console.print)
    except StackError as error:
        fail(str(error))
    console.print("[green]liverl is up[/green]")


@app.command()
def down(data_dir: Path | None = DataDir,
         force: bool = typer.Option(False, help="Stop without draining (may lose in-flight events).")) -> None:
    """Drain (every acknowledged event stored, every sample consumed), then stop."""
    from app.stack import StackError
    from app.stack import down as stack_down

    try:
        stack_down(settings_from(data_dir), say=console.print, force=force)
    except StackError as error:
        fail(str(error))


@app.command()
def restart(component: str = typer.Argument(..., help="A component `liverl status` lists (not a replica: "
                                             "`liverl replica` manages those)."),
            reason: str = typer.Option(..., "--reason", help="Why: kept in the audit log."),
            data_dir: Path | None = DataDir) -> None:
    """Stop one component and start it again, through the supervisor (the stack's one restarter)."""
    from app.stack import StackError
    from app.stack import restart as stack_restart

    try:
        restarted = stack_restart(settings_from(data_dir), component, reason)
    except StackError as error:
        fail(str(error))
    state = "[green]healthy[/green]" if restarted["healthy"] else "[red]not healthy yet[/red]"
    console.print(f"{component} restarted (pid {restarted['pid']}, restart {restarted['restarts']}): {state}")


@app.command()
def status(data_dir: Path | None = DataDir, as_json: bool = typer.Option(False, "--json")) -> None:
    """Each component: pid, URL, healthy, policy version served."""
    from app.stack import status as stack_status

    report = stack_status(settings_from(data_dir))
    if as_json:
        print(json.dumps(report, indent=2))
        return
    if not report["running"]:
        console.print("liverl is not running")
        raise typer.Exit(1)
    # Only replicas serve a policy version; the other components have none to show.
    print_rows([{k: c.get(k) for k in ("name", "pid", "url", "healthy", "state", "restarts", "policy_version",
                                        "role")}
                for c in report["components"]], f"cluster {report['cluster_id']}", whole=("name",))
    if store := report["broker_store"]:  # the embedded broker's disk (docs/reliability.md)
        console.print(f"broker store: {store['free_bytes'] / 1e9:.1f} GB free (refuses new events below "
                      f"{store['min_free_bytes'] / 1e9:.1f} GB), {store['stored_bytes'] / 1e6:.0f} MB kept"
                      + (": [red]DISK LOW, new events refused (503)[/red]" if store["disk_low"] else ""))
    if backlog := report["backlog"]:  # the supervisor's backlog watch
        console.print("backlog: " + "; ".join(
            f"{stage} " + ("[yellow]unknown (the broker did not answer)[/yellow]" if b is None else
                           f"{b['messages']:,} waiting" + (f", oldest {b['oldest_s']:.1f} s" if b["oldest_s"] else "")
                           + (" [red]LATE[/red]" if stage in backlog["late"] else ""))
            for stage, b in backlog["stages"].items()) + f" (measured {backlog['measured_s_ago']:.0f} s ago)")
    if pause := report["lending"]["paused"]:
        console.print(f"lending to rollouts paused by {pause['actor']} at {pause['at']}: {pause['reason']}")
    if report["lending"]["events"]:
        print_rows([{k: e[k] for k in ("timestamp", "action", "replica", "policy_version", "load",
                                       "tokens_per_s", "seconds", "bound_s", "why")}
                    for e in report["lending"]["events"]], "replicas lent to rollouts and taken back (latest)")
    if report["heldout"]:
        print_rows(report["heldout"], "held-out pass rate, latest versions scored (lost_skill: the held-out watch)")
    console.print(f"development keys: {report['keys_file']}")


# --- keys ----------------------------------------------------------------------------------
@keys_app.command("create")
def keys_create(tenant: str, admin: bool = typer.Option(False, help="An admin key."),
                scope: list[str] = typer.Option(["feedback"], help="What the key may send: feedback, "
                                                "trajectories (trains the shared policy; repeat the option)."),
                label: str = "", data_dir: Path | None = DataDir) -> None:
    """Create a key; it is printed once and stored only as a hash."""
    from pydantic import ValidationError

    from liverl.keys import KeyStore, Scope

    settings = settings_from(data_dir)
    try:  # each scope is checked by the key record's validation
        key, record = KeyStore(settings.keys_file).create(tenant, "admin" if admin else "tenant", label,
                                                          cast("list[Scope]", scope))
    except ValidationError as error:
        fail(f"{error.errors()[0]['loc'][0]} {error.errors()[0]['input']!r}: {error.errors()[0]['msg']}")
    operator_audit(settings, "keys.create", tenant, key_id=record.key_id, role=record.role, scopes=record.scopes)
    console.print(f"key id {record.key_id} for tenant {tenant}:\n{key}")


def operator_audit(settings: Settings, action: str, target: str, **details) -> None:
    """The CLI acting on files directly: audited under the operating-system user."""
    import getpass

    from liverl.audit import AuditLog

    AuditLog(settings.audit_file).record(f"cli:{getpass.getuser()}", action, target, **details)


@keys_app.command("list")
def keys_list(data_dir: Path | None = DataDir) -> None:
    from liverl.keys import KeyStore

    rows = [r.model_dump(mode="json") for r in KeyStore(settings_from(data_dir).keys_file).list()]
    print_rows(rows, "API keys")


@keys_app.command("revoke")
def keys_revoke(key_id: str, data_dir: Path | None = DataDir) -> None:
    from liverl.keys import KeyStore

    settings = settings_from(data_dir)
    try:
        record = KeyStore(settings.keys_file).revoke(key_id)
    except KeyError as error:
        fail(str(error))
    operator_audit(settings, "keys.revoke", record.tenant, key_id=key_id)
    console.print(f"revoked {key_id}")


# --- analytics -------------------------------------------------------------------------
def run_sql(settings: Settings, sql: str, fmt: str) -> str:
    """The operator's query, as admin (every tenant): the admin key from the keys file."""
    from liverl.keys import admin_headers

    try:
        response = httpx.post(settings.url(settings.ports.sink) + "/sql", headers=admin_headers(settings),
                              json={"sql": sql, "format": fmt}, timeout=60)
    except httpx.ConnectError:
        fail("the analytics sink is not reachable; is the stack up (`liverl status`)?")
    if response.status_code != 200:
        fail(response.json().get("detail", response.text))
    return response.text


@app.command()
def sql(query: str, fmt: str = typer.Option("table", "--format", help="json, table or csv."),
        data_dir: Path | None = DataDir) -> None:
    """Run one read-only SQL statement against the analytics tables."""
    print(run_sql(settings_from(data_dir), query, fmt), end="")


@app.command()
def metrics(data_dir: Path | None = DataDir) -> None:
    """Reward, accept rate and count per policy version per hour."""
    from feedback.warehouse import ROLLUP_SQL

    rows = json.loads(run_sql(settings_from(data_dir), ROLLUP_SQL, "json"))["data"]
    print_rows(rows, "per policy version, per hour")


# --- dead letters ------------------------------------------------------------------------
def read_dead_letters(settings: Settings) -> list:
    from liverl.contracts import DeadLetter, Topics
    from liverl.kafka import read_topic

    try:
        return [DeadLetter.model_validate_json(v) for v in read_topic(settings, Topics.DEAD_LETTER)]
    except ConnectionError as error:
        fail(str(error))


@dlq_app.command("list")
def dlq_list(data_dir: Path | None = DataDir) -> None:
    rows = [dict(id=d.event_id, topic=d.source_topic, tenant=d.tenant, reason=d.reason,
                 at=d.timestamp.isoformat(timespec="seconds"))
            for d in read_dead_letters(settings_from(data_dir))]
    print_rows(rows, f"{len(rows)} dead letters")


@dlq_app.command("show")
def dlq_show(event_id: str, data_dir: Path | None = DataDir) -> None:
    for d in read_dead_letters(settings_from(data_dir)):
        if d.event_id == event_id:
            console.print_json(d.model_dump_json())
            return
    fail(f"no dead letter {event_id}")


@dlq_app.command("replay")
def dlq_replay(event_id: str, payload_file: Path | None = typer.Option(
        None, "--payload", help="A fixed payload to send instead of the original."),
        data_dir: Path | None = DataDir) -> None:
    """Send a dead letter's payload (or its fixed version) back to its source topic."""
    from liverl.kafka import produce_sync

    settings = settings_from(data_dir)
    for d in read_dead_letters(settings):
        if d.event_id == event_id:
            payload = payload_file.read_bytes() if payload_file else d.payload.encode()
            produce_sync(settings, d.source_topic, payload)
            console.print(f"replayed {event_id} to {d.source_topic}")
            return
    fail(f"no dead letter {event_id}")


# --- policies -------------------------------------------------------------------------------
policy_app = typer.Typer(help="Policy versions: lineage, state, promotion, rollback, pins.")
app.add_typer(policy_app, name="policy")
Json = typer.Option(False, "--json", help="Print JSON instead of a table.")
ChangeReason = typer.Option(..., "--reason", help="Why (kept in the version's history and the audit log).")


def show(rows: list[dict], title: str, as_json: bool) -> None:
    if as_json:
        console.print_json(json.dumps(rows, default=str))
    else:
        print_rows(rows, title)


def change(settings: Settings, action: str, path: str, body: dict, act_here,
           component: str = "promotion controller", port: int | None = None) -> dict:
    """A state change goes through the component's admin API (the promotion controller's
    by default), which serialises it with the component's own moves; with the component
    down, the CLI acts itself (a rollback at 3 a.m. must not wait for the controller),
    audited as the OS user."""
    from liverl.keys import admin_headers

    try:
        response = httpx.post(settings.url(port or settings.ports.controller) + path, json=body,
                              headers=admin_headers(settings), timeout=900)
    except httpx.ConnectError:
        console.print(f"[yellow]the {component} is not reachable; acting directly[/yellow]")
        try:
            result = act_here()
        except (KeyError, ValueError, RuntimeError) as error:
            fail(error.args[0] if isinstance(error, KeyError) else str(error))
        operator_audit(settings, action, path, reason=body["reason"])
        return result if isinstance(result, dict) else result.model_dump()
    if response.is_error:
        detail = response.json().get("detail") if "json" in response.headers.get("content-type", "") else None
        if isinstance(detail, list):  # a request FastAPI refused: each field and what is wrong with it
            detail = "; ".join(f"{'.'.join(map(str, e['loc'][1:]))}: {e['msg']}" for e in detail)
        fail(detail or response.text)
    return response.json()


@policy_app.command("import")
def policy_import(model_dir: Path, reason: str = ChangeReason, data_dir: Path | None = DataDir,
                  as_json: bool = Json) -> None:
    """A Hugging Face model directory in as a policy version: the first one becomes stable
    (what replicas start from and `liverl replica add` checks them against); later ones
    are candidates, to promote by hand."""
    from policies.importer import import_version

    settings = settings_from(data_dir)
    source = model_dir.resolve()
    version = change(settings, "policy.import", "/admin/policies/import", {"reason": reason, "model_dir": str(source)},
                     lambda: import_version(settings, source, "cli"))
    if as_json:
        console.print_json(json.dumps(version))
    else:
        console.print(f"{model_dir} is {version['version']} ({version['state']})")


@policy_app.command("real-shape")
def policy_real_shape(
    out_dir: Path = typer.Argument(..., help="Where to write the model (HF format, bf16) and its tokenizer."),
    layers: int = typer.Option(1, min=1, help="Decoder layers (Qwen3-30B-A3B has 48)."),
    experts: int = typer.Option(128, min=1, help="Experts per layer (Qwen3-30B-A3B has 128; top-8 of them)."),
    seed: int = typer.Option(0, help="Seed of the random weights."),
    data_dir: Path | None = DataDir,
) -> None:
    """A random-initialised Qwen3-MoE of Qwen3-30B-A3B's per-layer shape and real vocabulary
    (151,936) with the starter's tokenizer: a model of real size to measure liverl against
    (then `liverl policy import` it, or serve it with LIVERL_STARTER__MODEL_DIR)."""
    from policies.real_shape import build_real_shape, parameter_count, real_shape_config
    from policies.starter import build_starter_policy

    settings = settings_from(data_dir)
    tokenizer_dir = settings.starter.model_dir or build_starter_policy(settings.starter.cache_dir,
                                                                        seed=settings.starter.seed)
    params = parameter_count(real_shape_config(layers, experts))
    with console.status(f"building {params / 1e9:.2f}B parameters ({params * 2 / 1e9:.1f} GB in bf16)"):
        build_real_shape(out_dir, Path(tokenizer_dir), layers=layers, experts=experts, seed=seed)
    console.print(f"{out_dir}: Qwen3-30B-A3B shape, {layers} layer(s) of {experts} experts, "
                  f"{params / 1e9:.2f}B parameters")


@policy_app.command("build-starter")
def policy_build_starter(
    seed: int = typer.Option(0, help="Seed of the recipe: 0 is the starter shipped in policies/starter_model."),
    out: Path | None = typer.Option(None, help="Where to write it (default: policies/starter_model for "
                                    "seed 0, else the starter cache, LIVERL_STARTER__CACHE_DIR)."),
) -> None:
    """Build the starter policy from its recipe (about 10 minutes on two cores) and write its files
    with their SHA-256 in SHA256SUMS, which every use checks. The recipe's bits depend on the CPU:
    what this writes for seed 0 is the starter once committed."""
    from policies.starter import SHIPPED, rebuild_starter

    out_dir = out or (SHIPPED if seed == 0 else Settings().starter.cache_dir)
    try:
        rebuild_starter(out_dir, seed=seed)
    except ValueError as error:
        fail(str(error))
    console.print(f"{out_dir}: the starter policy, seed {seed}, built from its recipe; "
                  f"SHA-256 in {out_dir / 'SHA256SUMS'}")


@policy_app.command("list")
def policy_list(data_dir: Path | None = DataDir, as_json: bool = Json) -> None:
    from policies.registry import Registry

    rows = [dict(version=v.version, parent=v.parent, state=v.state,
                 samples=v.window.samples if v.window else "", reward=round(v.metrics.get("mean_reward", 0), 3),
                 gate=(v.metrics.get("gate") or {}).get("reason", ""),
                 canary=(v.metrics.get("canary") or {}).get("verdict", ""), hash=v.content_hash[:12])
            for v in Registry(settings_from(data_dir).policies_dir).versions()]
    show(rows, "policy versions", as_json)


@policy_app.command("show")
def policy_show(version: str, data_dir: Path | None = DataDir, as_json: bool = Json) -> None:
    """A version's record (parent, sample window, gate and canary figures) and its history."""
    from policies.registry import Registry

    registry = Registry(settings_from(data_dir).policies_dir)
    try:
        record = registry.get(version)
    except KeyError as error:
        fail(error.args[0])
    if as_json:
        console.print_json(json.dumps({"version": record.model_dump(), "history": registry.history(version)}))
        return
    console.print_json(record.model_dump_json())
    print_rows(registry.history(version), f"history of {version}")


def version_change(data_dir: Path | None, action: str, path: str, body: dict, act, as_json: bool) -> None:
    """A change to which version serves, made by the promoter (`act(promoter)`) through
    the controller or, with it down, here; prints the version's new state."""
    from policies.registry import Registry
    from promotion.promoter import Promoter

    settings = settings_from(data_dir)
    result = change(settings, action, path, body, lambda: act(Promoter(settings, Registry(settings.policies_dir))))
    console.print_json(json.dumps(result)) if as_json else console.print(f"{result['version']}: {result['state']}")


@policy_app.command("promote")
def policy_promote(version: str, reason: str = ChangeReason, data_dir: Path | None = DataDir,
                   as_json: bool = Json) -> None:
    """Roll a version out: one canary replica verified, then every replica."""
    version_change(data_dir, "policy.promote", f"/admin/policies/{version}/promote", {"reason": reason},
                   lambda promoter: promoter.promote(version, "cli", reason), as_json)


@policy_app.command("abort")
def policy_abort(version: str, reason: str = ChangeReason, data_dir: Path | None = DataDir,
                 as_json: bool = Json) -> None:
    """Take a canary off users: stable back on its replica, verified; the learner rewinds to stable."""
    version_change(data_dir, "policy.abort", f"/admin/policies/{version}/abort", {"reason": reason},
                   lambda promoter: promoter.abort(version, "cli", reason), as_json)


@policy_app.command("rollback")
def policy_rollback(reason: str = ChangeReason, data_dir: Path | None = DataDir,
                    to: str | None = typer.Option(None, help="The version to put back (default: the "
                                                     "previous stable one)."), as_json: bool = Json) -> None:
    """Take the stable version out of serving: the previous stable one (or --to) returns
    everywhere, verified before this returns, and the learner continues from it."""
    version_change(data_dir, "policy.rollback", "/admin/rollback", {"reason": reason, "to": to},
                   lambda promoter: promoter.rollback("cli", reason, to=to), as_json)


def pin_command(pinned: bool, reason: str, data_dir: Path | None, as_json: bool) -> None:
    from policies.registry import Registry

    settings = settings_from(data_dir)
    result = change(settings, "policy.pin" if pinned else "policy.unpin", "/admin/pin" if pinned else "/admin/unpin",
                    {"reason": reason},
                    lambda: Registry(settings.policies_dir).pin("stable", "cli", reason, pinned=pinned))
    if as_json:
        console.print_json(json.dumps(result))
    else:
        console.print(f"stable {'pinned at ' + str(result['version']) if pinned else 'unpinned'}")


@policy_app.command("pin")
def policy_pin(reason: str = ChangeReason, data_dir: Path | None = DataDir, as_json: bool = Json) -> None:
    """Hold stable where it is: no automatic promotion until unpinned (the guard still
    aborts a clearly worse canary)."""
    pin_command(True, reason, data_dir, as_json)


@policy_app.command("unpin")
def policy_unpin(reason: str = ChangeReason, data_dir: Path | None = DataDir, as_json: bool = Json) -> None:
    pin_command(False, reason, data_dir, as_json)


def alias_command(alias: str, version: str | None, reason: str, data_dir: Path | None, as_json: bool) -> None:
    from policies.registry import Registry
    from promotion.promoter import Promoter

    settings = settings_from(data_dir)
    result = change(settings, "policy.alias", f"/admin/aliases/{alias}", {"reason": reason, "version": version},
                    lambda: Promoter(settings, Registry(settings.policies_dir)).move_alias(
                        alias, version, "cli", reason))
    if as_json:
        console.print_json(json.dumps(result))
    else:
        console.print(f"{alias} -> {version}" if version else f"{alias} removed")


@policy_app.command("alias")
def policy_alias(alias: str, version: str, reason: str = ChangeReason, data_dir: Path | None = DataDir,
                 as_json: bool = Json) -> None:
    """Name a version for your team (champion, challenger...): requests with
    `x-liverl-alias: NAME` go to the replicas serving it. stable and canary move only by
    promote, abort and rollback."""
    alias_command(alias, version, reason, data_dir, as_json)


@policy_app.command("unalias")
def policy_unalias(alias: str, reason: str = ChangeReason, data_dir: Path | None = DataDir,
                   as_json: bool = Json) -> None:
    """Remove a team's alias."""
    alias_command(alias, None, reason, data_dir, as_json)


@policy_app.command("diff")
def policy_diff(a: str, b: str, data_dir: Path | None = DataDir, as_json: bool = Json,
                kl_completions: int = typer.Option(64, min=0, help="Logged completions the KL between them "
                                                   "is measured on (0: skip).")) -> None:
    """Two versions side by side: live reward and accept rate per tenant with 95% intervals
    (ClickHouse), the offline gate's estimate and KL from stable, train/inference mismatch,
    the KL between them on logged production completions, and the delta size."""
    from promotion.reports import ReportError, SinkError, diff

    try:
        answer = diff(settings_from(data_dir), a, b, kl_completions)
    except (ReportError, SinkError, KeyError) as error:
        fail(error.args[0])
    figures = answer["versions"]
    if as_json:
        console.print_json(json.dumps(answer))
        return
    fields = ["state", "parent", "offline_estimate", "offline_ess", "kl_from_stable_at_gate", "logprob_mismatch_mean",
              "delta_bytes_from_parent"]
    print_rows([{"": f, a: figures[a][f], b: figures[b][f]} for f in fields], f"{a} against {b}")

    def accept_cell(live: dict | None) -> str:
        if not live or live["accept_rate"] is None:
            return "-"
        return f"{live['accept_rate']:.3f} [{live['accept_ci'][0]:.3f}, {live['accept_ci'][1]:.3f}] n {live['served']}"

    tenants = sorted({t for v in (a, b) for t in figures[v]["tenants"]})
    print_rows([{"tenant": t, **{f"{v} accept (95% CI)": accept_cell(figures[v]["tenants"].get(t)) for v in (a, b)}}
                for t in tenants], "live, per tenant")
    kl = answer["kl_on_logged"]
    console.print(f"KL({a} || {b}) per token on {kl['completions']} logged completions: {kl['value']}"
                  + (f" ({kl['why']})" if kl.get("why") else ""))


def utc_text(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="seconds")


@policy_app.command("history")
def policy_history(version: str | None = typer.Argument(None, help="One version's (default: all)."),
                   tenant: str | None = typer.Option(None, help="With --at: which version served this tenant."),
                   at: datetime | None = typer.Option(None, help="With --tenant: when (UTC)."),
                   window_s: float = typer.Option(60.0, help="With --at: seconds either side of it."),
                   data_dir: Path | None = DataDir, as_json: bool = Json) -> None:
    """Every state change and pin, oldest first: who, when, why. With --tenant and --at:
    which versions served that tenant around that time (ClickHouse's request log), and
    what was stable and canary then (the registry)."""
    from policies.registry import Registry
    from promotion.reports import ReportError, SinkError, history, served_at

    settings = settings_from(data_dir)
    if (tenant is None) != (at is None):
        fail("--tenant and --at go together")
    if tenant is not None and at is not None:  # both or neither
        try:
            answer = served_at(settings, tenant, at, window_s)
        except (ReportError, SinkError) as error:
            fail(str(error))
        if as_json:
            console.print_json(json.dumps(answer))
        else:
            console.print(f"at {answer['at']}: stable {', '.join(answer['stable']) or '-'}, "
                          f"canary {', '.join(answer['canary']) or '-'}")
            print_rows(answer["served"], f"what served {tenant} within {window_s:g} s of {answer['at']}")
        return
    rows = [dict(e, at=utc_text(e["at"])) for e in history(Registry(settings.policies_dir), version)]
    show(rows, f"history of {version or 'every version'}", as_json)


# --- demo ------------------------------------------------------------------------------------
class DemoLoad(StrEnum):
    constant = "constant"
    day = "day"


@app.command()
def demo(minutes: float = typer.Option(10.0, help="How long the simulated product runs."),
         users: int = typer.Option(8, help="Concurrent simulated users."),
         seed: int = typer.Option(0, help="Seed of the users' prompts and sampling."),
         out: Path = typer.Option(Path("demo-output"), help="Where the plot and summary go."),
         load: DemoLoad = typer.Option(DemoLoad.constant, help="constant: every user all the time (the learning "
                                       "benchmark's mode); day: traffic follows a compressed day, and idle "
                                       "replicas are lent to coding rollouts in its troughs."),
         day_minutes: float = typer.Option(4.0, help="With --load day: the length of one simulated day."),
         heldout: int = typer.Option(50, help="With --load day: held-out coding tasks each evaluated version "
                                     "is scored on (greedy).")) -> None:
    """Start the stack, let simulated users teach the policy a hidden rule, show it learning."""
    import signal
    import sys

    from app.demo import USER_MAX_TOKENS, demo_settings, run_demo
    from app.stack import StackError, wipe_data_dir

    # `kill` (a stopped benchmark, a CI timeout) unwinds as Ctrl-C does: the stack goes down with the demo.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    settings = demo_settings(day=load is DemoLoad.day)
    try:
        wipe_data_dir(settings)  # every demo starts from the starter policy
    except StackError as error:
        fail(str(error))
    result = run_demo(settings, minutes, users, seed, max_tokens=USER_MAX_TOKENS, out_dir=out, console=console,
                      day_minutes=day_minutes if load is DemoLoad.day else None, heldout=heldout)
    # The per-version table is printed above; the curve is in the plot and summary.json.
    console.print_json(json.dumps({k: v for k, v in result.items() if k not in ("clickhouse", "learning_curve")}))


# --- learner --------------------------------------------------------------------------------
replica_app = typer.Typer(help="The serving replicas the gateway routes to: started by `liverl up`, or "
                          "registered here when they run elsewhere (production).")
app.add_typer(replica_app, name="replica")


@replica_app.command("list")
def replica_list(data_dir: Path | None = DataDir, as_json: bool = Json) -> None:
    from liverl.pool import read_pool

    show([r.model_dump() for r in read_pool(settings_from(data_dir)).replicas], "replicas", as_json)


@replica_app.command("add")
def replica_add(name: str, url: str, reason: str = ChangeReason, data_dir: Path | None = DataDir,
                version: str | None = typer.Option(None, help="The version it serves (default: stable, or "
                                                      "the alias's version)."),
                alias: str | None = typer.Option(None, help="Dedicate it to a team alias: it answers only "
                                                    "requests naming the alias, and no swap touches it."),
                dtype: str | None = typer.Option(None, help="What it computes in (vLLM's --dtype; default "
                                                    "serving.dtype): sets the probe's tolerance.")) -> None:
    """Route to a vLLM replica started elsewhere (`vllm serve` on the version's weights,
    served model name liverl-policy; serving/replica.Dockerfile's entry adds the routed
    experts to streamed answers): taken only once its answers reproduce the version's
    probe logprobs, so the gateway never sends users to the wrong weights."""
    import httpx as http

    from liverl.pool import Replica, edit_pool, read_pool
    from policies.registry import Registry
    from serving.swap import VerificationFailed, verify

    settings = settings_from(data_dir)
    registry = Registry(settings.policies_dir)
    if alias is not None:
        if alias not in registry.aliases():
            fail(f"no team alias {alias!r} (`liverl policy alias {alias} VERSION` first)")
        if version not in (None, registry.aliases()[alias]):
            fail(f"alias {alias} names {registry.aliases()[alias]}, not {version}")
        version = registry.aliases()[alias]
    if not version:
        stable = registry.stable()
        if stable is None:
            fail("no stable version yet: `liverl policy import` one first")
        version = stable.version
    try:
        record = registry.get(version)
    except KeyError as error:
        fail(error.args[0])
    pool = read_pool(settings)
    if any(r.name == name for r in pool.replicas):
        fail(f"a replica named {name!r} is already in the pool (`liverl replica remove` it first)")
    try:
        tolerance = settings.learner.probe_tolerance_for(dtype or settings.serving.dtype)
        diff = verify(url, Path(record.model_dir), tolerance)
    except VerificationFailed as error:
        fail(f"{url} does not serve {record.version}'s weights: {error}")
    except http.HTTPError as error:
        fail(f"{url} does not answer as a vLLM replica: {error!r}")
    with edit_pool(settings) as pool:
        if any(r.name == name for r in pool.replicas):
            fail(f"a replica named {name!r} was added meanwhile")
        pool.replicas.append(Replica(name=name, url=url, policy_version=record.version,
                                     model_dir=record.model_dir, alias=alias))
    operator_audit(settings, "replica.add", name, reason=reason, url=url, version=record.version, alias=alias)
    console.print(f"{name} at {url} serves {record.version} (probe within {diff:.1e}); the gateway routes "
                  + (f"requests for alias {alias} to it" if alias else "to it"))


@replica_app.command("remove")
def replica_remove(name: str, reason: str = ChangeReason, data_dir: Path | None = DataDir) -> None:
    """Stop routing to a replica (the process itself is not touched)."""
    from liverl.pool import edit_pool

    settings = settings_from(data_dir)
    with edit_pool(settings) as pool:
        gone = [r for r in pool.replicas if r.name == name]
        if not gone:
            fail(f"no replica named {name!r} (replicas: {', '.join(r.name for r in pool.replicas) or 'none'})")
        left = [r for r in pool.replicas if r.name != name]
        stable = pool.aliases.get("stable")
        if stable and not any(r.enabled and r.alias is None and r.policy_version == stable for r in left):
            fail(f"{name} is the last replica serving stable ({stable}); add another first")
        pool.replicas = left
    operator_audit(settings, "replica.remove", name, reason=reason, url=gone[0].url)
    console.print(f"{name} removed from the pool; the gateway no longer routes to it")


learner_app = typer.Typer(help="The learner: its status; pause or resume learning.")
app.add_typer(learner_app, name="learner")


def learner_call(data_dir: Path | None, verb: str, reason: str) -> None:
    from liverl.keys import admin_headers

    settings = settings_from(data_dir)
    try:
        # A pause answers once the step in flight is done: allow for a long one.
        response = httpx.post(settings.url(settings.ports.learner) + f"/{verb}", params={"reason": reason},
                              headers=admin_headers(settings), timeout=620)
    except httpx.ConnectError:
        fail("the learner is not reachable; is the stack up (`liverl status`)?")
    if response.is_error:
        fail(f"the learner answered {response.status_code}: {response.text}")
    console.print_json(response.text)


Reason = typer.Option(..., "--reason", help="Why (recorded in the audit log).")


@learner_app.command("pause")
def learner_pause(reason: str = Reason, data_dir: Path | None = DataDir) -> None:
    """Stop consuming and writing versions (serving is untouched); returns once the step in
    flight is done, so no version is written after it."""
    learner_call(data_dir, "pause", reason)


@learner_app.command("status")
def learner_status(data_dir: Path | None = DataDir, as_json: bool = Json) -> None:
    """The version it trains on top of, samples waiting, paused or not, and what it dropped."""
    settings = settings_from(data_dir)
    try:
        health = httpx.get(settings.url(settings.ports.learner) + "/health", timeout=10).json()
    except httpx.TransportError:
        fail("the learner is not reachable; is the stack up (`liverl status`)?")
    from policies.registry import Registry

    stable = Registry(settings.policies_dir).stable()
    health["stable"] = stable.version if stable else None
    health["versions_ahead_of_stable"] = (int(health["version"][1:]) - stable.seq) if stable else None
    if as_json:
        console.print_json(json.dumps(health))
    else:
        print_rows([{k: v for k, v in health.items() if k != "ok"}], "learner")


@learner_app.command("resume")
def learner_resume(reason: str = Reason, data_dir: Path | None = DataDir) -> None:
    learner_call(data_dir, "resume", reason)


capacity_app = typer.Typer(help="Lending idle replicas to rollouts: its state; pause or resume lending.")
app.add_typer(capacity_app, name="capacity")


def capacity_call(data_dir: Path | None, verb: str, reason: str) -> None:
    """Through the scheduler's admin API; with the scheduler down, on its pause file
    directly (it reads it when it starts)."""
    import getpass

    from liverl.lending import LendingPause, set_pause

    settings = settings_from(data_dir)

    def act_here() -> dict:
        pause = LendingPause(actor=f"cli:{getpass.getuser()}", reason=reason, at=datetime.now(UTC))
        set_pause(settings, pause if verb == "pause" else None)
        console.print(f"lending {verb}d for when the scheduler runs (a replica lent now stays lent until then)")
        return {"paused": verb == "pause"}

    result = change(settings, f"capacity.{verb}", f"/admin/{verb}", {"reason": reason}, act_here,
                    component="capacity scheduler", port=settings.ports.capacity)
    console.print_json(json.dumps(result))


@capacity_app.command("pause")
def capacity_pause(reason: str = Reason, data_dir: Path | None = DataDir) -> None:
    """Lend nothing and take every lent replica back now, whatever the load, until resumed
    (kept across restarts); returns once none is lent."""
    capacity_call(data_dir, "pause", reason)


@capacity_app.command("resume")
def capacity_resume(reason: str = Reason, data_dir: Path | None = DataDir) -> None:
    """Lend again when the load allows."""
    capacity_call(data_dir, "resume", reason)


@capacity_app.command("status")
def capacity_status(data_dir: Path | None = DataDir, as_json: bool = Json) -> None:
    """Whether lending is paused (who, why), the replicas lent and in production, and the
    latest lends and take-backs."""
    from liverl.lending import lending_state, scheduler_answers

    settings = settings_from(data_dir)
    report = lending_state(settings) | {"scheduler": scheduler_answers(settings)}
    if as_json:
        console.print_json(json.dumps(report))
        return
    pause = report["paused"]
    console.print(f"lending paused by {pause['actor']} at {pause['at']}: {pause['reason']}" if pause
                  else "lending on (when the load allows)" if report["scheduler"]
                  else "lending off: the capacity scheduler is not running")
    console.print(f"lent: {', '.join(report['lent']) or 'none'}; production: {', '.join(report['production'])}")
    if report["events"]:
        print_rows([{k: e[k] for k in ("timestamp", "action", "replica", "policy_version", "load", "seconds", "why")}
                    for e in report["events"]], "lends and take-backs (latest)")


@app.command()
def audit(limit: int = typer.Option(50, help="Newest entries to show."),
          action: str | None = typer.Option(None, help="Only this action, e.g. keys.create."),
          as_json: bool = typer.Option(False, "--json", help="JSON lines instead of a table."),
          data_dir: Path | None = DataDir) -> None:
    """Every admin action (keys, learner control, SQL, promotion), who took it and why."""

    from liverl.audit import AuditLog

    entries = AuditLog(settings_from(data_dir).audit_file).entries(limit, action)
    if not entries and not as_json:
        console.print("no audit entries")
        return
    if as_json:
        for entry in entries:
            print(entry.model_dump_json())
        return
    print_rows([{"at": datetime.fromtimestamp(e.at, UTC).strftime("%Y-%m-%d %H:%M:%S"),
                 "actor": e.actor, "action": e.action, "target": e.target, "reason": e.reason,
                 "details": json.dumps(e.details)[:80]} for e in entries], title="audit log")


def main() -> None:
    """The `liverl` command; a bad setting is one line naming its variable, not a traceback."""
    from pydantic import ValidationError

    from liverl.settings import ConfigFileError, describe_error

    try:
        app()
    except ValidationError as error:
        if error.title not in ("Settings", "WithDefaults"):
            raise
        console.print(f"[red]error:[/red] {describe_error(error)}", soft_wrap=True)
        raise SystemExit(1) from None
    except ConfigFileError as error:
        console.print(f"[red]error:[/red] {error}", soft_wrap=True)
        raise SystemExit(1) from None
    except Exception as error:  # a starter that fails its SHA-256: one line naming the rebuild command
        starter = sys.modules.get("policies.starter")  # loaded already where that is what this is
        if starter is None or not isinstance(error, starter.StarterMismatch):
            raise
        console.print(f"[red]error:[/red] {error}", soft_wrap=True)
        raise SystemExit(1) from None


if __name__ == "__main__":
    main()
