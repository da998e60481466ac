"""The data plane end to end on real parts: vLLM, Tansu, librdkafka, chdb, FastAPI."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid

import httpx
import pytest
from helpers import item, sql, trajectory, wait_for
from liverl_client import FeedbackClient
from openai import OpenAI

from liverl.contracts import Topics
from liverl.kafka import read_topic
from liverl.pool import read_pool


@pytest.fixture(scope="module")
def openai_client(settings, dev_keys) -> OpenAI:
    return OpenAI(base_url=settings.url(settings.ports.gateway) + "/v1", api_key=dev_keys["tenant_key"])


def liverl(settings, *args: str) -> subprocess.CompletedProcess:
    """The CLI as an operator runs it: only the data directory points at the stack."""
    return subprocess.run([sys.executable, "-m", "app.cli", *args, "--data-dir", str(settings.data_dir)],
                          capture_output=True, text=True, timeout=120)


def test_completion_feedback_reward_row_in_clickhouse(settings, openai_client, dev_keys):
    raw = openai_client.completions.with_raw_response.create(
        model="liverl", prompt="def add(a, b):\n", max_tokens=12, temperature=1.0)
    completion = raw.parse()
    completion_id = completion.model_extra["completion_id"]
    served_by = raw.headers["x-liverl-policy-version"]
    # Which replica answered, for an operator following one request (and the day's check
    # that production never reached a lent replica).
    assert raw.headers["x-liverl-replica"] in {r.name for r in read_pool(settings).replicas}
    with FeedbackClient(settings.url(settings.ports.api), dev_keys["tenant_key"]) as client:
        client.accept(completion_id)
    assert client.rejected == []
    # Rows, not the column names the JSON's meta always holds: those made this wait a no-op.
    rows = wait_for(lambda: json.loads(liverl(settings, "sql", f"SELECT reward, reward_source, policy_version "
                                                           f"FROM samples WHERE sample_id = 'dev:{completion_id}'",
                                              "--format", "json").stdout)["data"], timeout=30)
    assert rows == [{"reward": 1, "reward_source": "feedback", "policy_version": served_by}]
    trajectory = sql(settings, f"SELECT completion_tokens, prompt_tokens, completion_text FROM trajectories "
                               f"WHERE completion_id = '{completion_id}'")[0]
    assert trajectory["completion_tokens"] == completion.usage.completion_tokens
    assert trajectory["completion_text"] == completion.choices[0].text


def test_streaming_chat_records_the_same_tokens(settings, openai_client):
    chunks = list(openai_client.chat.completions.create(
        model="liverl", messages=[{"role": "user", "content": "write a loop"}], max_tokens=10, stream=True))
    completion_id = chunks[0].model_extra["completion_id"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    row = wait_for(lambda: sql(settings, f"SELECT completion_text, completion_tokens FROM trajectories "
                                         f"WHERE completion_id = '{completion_id}'"))[0]
    assert row["completion_text"] == text
    assert row["completion_tokens"] > 0
    requests = wait_for(lambda: sql(settings, f"SELECT status, stream FROM requests "
                                              f"WHERE completion_id = '{completion_id}'"))
    assert requests == [{"status": 200, "stream": 1}]


def test_trajectory_carries_what_training_needs(settings, openai_client):
    from liverl.contracts import Trajectory

    completion = openai_client.completions.create(model="liverl", prompt="import os\n", max_tokens=8)
    completion_id = completion.model_extra["completion_id"]

    def find():
        for raw in read_topic(settings, Topics.TRAJECTORIES):
            t = Trajectory.model_validate_json(raw)
            if t.completion_id == completion_id:
                return t
    t = wait_for(find)
    assert len(t.completion_token_ids) == len(t.completion_logprobs) == completion.usage.completion_tokens
    assert all(lp <= 0 for lp in t.completion_logprobs)
    assert t.prompt_token_ids and t.tenant == "dev" and t.replica in {r.name for r in read_pool(settings).replicas}
    # The experts each MoE layer chose for every token but the last (which no forward read).
    assert t.routed_experts is not None
    assert t.routed_experts.shape == (len(t.prompt_token_ids) + len(t.completion_token_ids) - 1, 3, 2)


def test_reading_a_topic_writes_no_warning(settings, stack, caplog):
    """The controller reads topics every few seconds: a warning each time buries real ones."""
    import logging

    with caplog.at_level(logging.WARNING):
        read_topic(settings, Topics.TRAJECTORIES)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_bad_input_gets_documented_answers(api, settings):
    assert api.post("/v1/ingestion", content=b"{not json").status_code == 400
    assert api.post("/v1/ingestion", json={"items": []}).status_code == 422
    too_many = {"batch": [item(f"x{i}", {"kind": "accept", "completion_id": "c"})
                          for i in range(settings.ingest.max_batch_items + 1)]}
    assert api.post("/v1/ingestion", json=too_many).status_code == 413
    bad = [
        ({"id": "b1", "type": "feedback", "body": {}}, "timestamp: Field required"),
        (item("b2", {"kind": "accept"}), "body.completion_id: Field required"),
        (item("b3", {"kind": "accept", "completion_id": "c", "extra": 1}), "body.extra: Extra inputs"),
        (item("b4", {"kind": "thumbs", "completion_id": "c", "up": "maybe"}), "body.up:"),
        (item("b5", {"kind": "meh", "completion_id": "c"}), "body.kind: must be one of"),
        (item("b6", {"kind": "score", "completion_id": "c", "score": "NaN"}), "body.score:"),
        (item("b7", {"kind": "score", "completion_id": "c", "score": 1e400}), "body.score:"),
        (dict(item("b8", {"kind": "accept", "completion_id": "c"}), type="nope"), "type:"),
        (item("b9", {"kind": "edit", "completion_id": "c", "corrected_text": "x" * 70_000}),
         "body.corrected_text: String should have at most"),
        # Under the field's limit, over the item limit once it is an event.
        (item("b10", {"kind": "edit", "completion_id": "c", "corrected_text": "x" * 65_500}), "larger than"),
    ]
    response = api.post("/v1/ingestion", content=json.dumps({"batch": [b for b, _ in bad]})
                        .replace('"NaN"', "NaN"))
    assert response.status_code == 207
    results = response.json()["results"]
    for (sent, expected), result in zip(bad, results, strict=True):
        assert result["status"] >= 400 and expected in result["error"], (sent, result)
    assert response.json()["accepted"] == 0


def test_wrong_keys_are_refused(settings, dev_keys):
    url = settings.url(settings.ports.api) + "/v1/ingestion"
    body = {"batch": [item("k1", {"kind": "accept", "completion_id": "c"})]}
    assert httpx.post(url, json=body).status_code == 401
    assert httpx.post(url, json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    gateway = settings.url(settings.ports.gateway) + "/v1/completions"
    assert httpx.post(gateway, json={"prompt": "x"}, headers={"Authorization": "Bearer wrong"}).status_code == 401


def test_revoked_key_stops_working(settings, dev_keys):
    from liverl.keys import KeyStore

    store = KeyStore(settings.keys_file)
    key, record = store.create("temp")
    url = settings.url(settings.ports.api) + "/v1/ingestion"
    headers = {"Authorization": f"Bearer {key}"}
    body = {"batch": [item(f"r-{uuid.uuid4().hex}", {"kind": "accept", "completion_id": "c"})]}
    assert httpx.post(url, json=body, headers=headers).status_code == 207
    assert liverl(settings, "keys", "revoke", record.key_id).returncode == 0
    assert httpx.post(url, json=body, headers=headers).status_code == 401


def test_duplicates_count_once_and_unknown_or_foreign_feedback_never_trains(
        settings, openai_client, api, dev_keys):
    from liverl.keys import KeyStore

    completion_id = openai_client.completions.create(
        model="liverl", prompt="x = ", max_tokens=4).model_extra["completion_id"]
    feedback = item(f"d-{uuid.uuid4().hex}", {"kind": "reject", "completion_id": completion_id})
    first = api.post("/v1/ingestion", json={"batch": [feedback, feedback]}).json()
    assert [r["status"] for r in first["results"]] == [201, 200] and first["results"][1]["duplicate"]
    assert api.post("/v1/ingestion", json={"batch": [feedback]}).json()["results"][0]["duplicate"]
    # Another tenant cannot give feedback on this tenant's completion: its feedback names
    # a completion of its own, which does not exist.
    other_key, _ = KeyStore(settings.keys_file).create("mallory")
    foreign = item(f"m-{uuid.uuid4().hex}", {"kind": "accept", "completion_id": completion_id})
    httpx.post(settings.url(settings.ports.api) + "/v1/ingestion", json={"batch": [foreign]},
               headers={"Authorization": f"Bearer {other_key}"})
    unknown_id = f"cmpl-unknown-{uuid.uuid4().hex}"
    api.post("/v1/ingestion", json={"batch": [item(f"u-{uuid.uuid4().hex}",
                                                   {"kind": "accept", "completion_id": unknown_id})]})

    window = settings.feedback.reward_window_s + 30  # what cannot join is dead-lettered when its window closes
    letters = wait_for(lambda: (rows := sql(settings, "SELECT reason, tenant FROM dead_letters")) and
                       any("unjoinable" in r["reason"] for r in rows) and rows, timeout=window)
    letters = wait_for(lambda: (rows := sql(settings, "SELECT reason, tenant FROM dead_letters "
                                                      "WHERE tenant = 'mallory'")) and rows, timeout=window)
    assert all("unjoinable" in r["reason"] for r in letters)
    samples = wait_for(lambda: sql(settings, f"SELECT reward, tenant FROM samples FINAL "
                                             f"WHERE sample_id = 'dev:{completion_id}'"), timeout=window)
    assert samples == [{"reward": 0, "tenant": "dev"}]
    assert sql(settings, f"SELECT count() AS n FROM samples WHERE sample_id = 'dev:{unknown_id}'") == [{"n": 0}]


def sink_writes(settings, table: str) -> float:
    metrics = httpx.get(settings.url(settings.ports.sink) + "/metrics/", timeout=10).text
    prefix = f'liverl_sink_writes_total{{table="{table}"}} '
    return sum(float(line.removeprefix(prefix)) for line in metrics.splitlines() if line.startswith(prefix))


def test_events_arriving_together_reach_clickhouse_in_one_insert(settings, api):
    """Each insert costs ClickHouse a part to merge, and the sink a duplicate check, whatever
    its size: feedback sent one event at a time for a second is stored in a few inserts."""
    before, sent = sink_writes(settings, "feedback_events"), []
    for i in range(20):
        sent.append(f"w-{uuid.uuid4().hex}")
        api.post("/v1/ingestion", json={"batch": [item(sent[-1], {"kind": "accept",
                                                                   "completion_id": f"cmpl-w-{i}"})]})
        time.sleep(0.05)
    quoted = ",".join(f"'{event_id}'" for event_id in sent)
    wait_for(lambda: sql(settings, f"SELECT count() AS n FROM feedback_events WHERE event_id IN ({quoted})")
             == [{"n": 20}])
    assert sink_writes(settings, "feedback_events") - before <= 4


def test_a_completion_takes_a_bounded_number_of_feedback_events(settings, openai_client, api):
    completion_id = openai_client.completions.create(
        model="liverl", prompt="y = ", max_tokens=4).model_extra["completion_id"]
    cap = settings.feedback.max_feedback_per_completion
    events = [item(f"many-{i}-{uuid.uuid4().hex}", {"kind": "thumbs", "completion_id": completion_id, "up": True})
              for i in range(cap + 2)]
    assert api.post("/v1/ingestion", json={"batch": events}).json()["accepted"] == cap + 2
    refused = wait_for(lambda: (rows := sql(settings, f"SELECT payload FROM dead_letters WHERE reason = "
                                                      f"'more than {cap} feedback events for this completion' "
                                                      f"AND position(payload, '{completion_id}') > 0"))
                       and len(rows) == 2 and rows)
    assert {json.loads(r["payload"])["event_id"] for r in refused} == {e["id"] for e in events[cap:]}
    # At most one sample revision per joined event (fewer if the trajectory came last).
    query = f"SELECT count() AS n, max(revision) AS last FROM samples WHERE sample_id = 'dev:{completion_id}'"
    revisions = wait_for(lambda: (rows := sql(settings, query)) and rows[0]["n"] and rows)
    assert revisions[0]["last"] < cap


def test_window_closes_with_default_reward_and_late_feedback_is_a_revision(settings, api):
    # A window is counted from when its completion was served (the trajectory's timestamp), so
    # one served most of a window ago closes in seconds, not in a whole window of waiting.
    completion_id = f"cmpl-late-{uuid.uuid4().hex}"
    served_at = time.time() - settings.feedback.reward_window_s + 3
    api.post("/v1/ingestion", json={"batch": [trajectory(completion_id, served_at)]}).raise_for_status()
    # The default reward config emits no sample when nobody answers; tenants opt in.
    wait_for(lambda: sql(settings, f"SELECT count() AS n FROM trajectories WHERE completion_id = '{completion_id}'")
             [0]["n"])
    time.sleep(max(served_at + settings.feedback.reward_window_s - time.time(), 0)
               + 2 * settings.feedback.sweep_interval_s)
    api.post("/v1/ingestion", json={"batch": [item(f"l-{uuid.uuid4().hex}",
                                                   {"kind": "accept", "completion_id": completion_id})]})
    rows = wait_for(lambda: sql(settings, f"SELECT reward_source, revision FROM samples "
                                          f"WHERE sample_id = 'dev:{completion_id}'"))
    assert rows == [{"reward_source": "late", "revision": 0}]


def test_sql_is_read_only_and_metrics_prints_the_rollup(settings):
    refused = liverl(settings, "sql", "DROP TABLE samples")
    assert refused.returncode == 1 and "only SELECT" in refused.stdout
    rollup = liverl(settings, "metrics")
    assert rollup.returncode == 0 and "accept_rate" in rollup.stdout


def test_status_reports_every_component(settings):
    report = json.loads(liverl(settings, "status", "--json").stdout)
    names = {c["name"]: c for c in report["components"]}
    assert set(names) >= {"broker", "sink", "feedback", "api", "replica-0", "gateway"}
    assert all(c["healthy"] for c in names.values())
    assert names["replica-0"]["policy_version"].startswith("v")
    assert report["keys_file"].endswith("dev-keys.json")
    table = liverl(settings, "status")
    assert table.returncode == 0 and "replica-0" in table.stdout and "api" in table.stdout, table.stderr
    # The skill guard's test scores versions with the real evaluator beside this stack.
    assert all(0 <= row["pass_rate"] <= 1 and row["tasks"] > 0 for row in report["heldout"])
    # The stream yields to ingest and serving: niced, and on the CPUs it was given.
    for background in ("sink", "feedback"):
        pid = names[background]["pid"]
        assert os.getpriority(os.PRIO_PROCESS, pid) == settings.stream_nice
        autogroup = f"/proc/{pid}/autogroup"  # the session's nice is what counts there
        if os.path.exists(autogroup):
            assert open(autogroup).read().split()[-1] == str(settings.stream_nice)
        assert os.sched_getaffinity(pid) == set(settings.stream_cpus)


def test_on_call_sees_the_backlog_and_is_alerted_once_when_a_stage_falls_behind(settings, api):
    from app.backlog_watch import BacklogWatch

    # The supervisor's watch measures it for status (every supervisor.backlog_every_s).
    report = wait_for(lambda: json.loads(liverl(settings, "status", "--json").stdout)["backlog"], timeout=60)
    assert set(report["stages"]) == {"stream", "sink"} and report["measured_s_ago"] < 60
    assert "backlog: stream" in liverl(settings, "status").stdout
    # A sink that stops taking events (stopped here for a few seconds: a stuck one) is late
    # past the alert's age; on-call hears it once, and again only after it caught up.
    alerts: list[str] = []
    restarts: list[str] = []  # recorded, not done: the sink is resumed below
    watch = BacklogWatch(settings.model_copy(update={"supervisor": settings.supervisor.model_copy(
        update={"backlog_alert_s": 1.0, "backlog_stall_s": 2.0})}), lambda stage, reason: alerts.append(stage),
        lambda component, reason: restarts.append(component))
    sink = next(c for c in json.loads(liverl(settings, "status", "--json").stdout)["components"]
                if c["name"] == "sink")
    os.kill(sink["pid"], signal.SIGSTOP)
    try:
        batch = [item(f"backlog-{uuid.uuid4().hex}", {"kind": "accept", "completion_id": f"c-{uuid.uuid4().hex}"})
                 for _ in range(5)]
        assert api.post("/v1/ingestion", json={"batch": batch}).json()["accepted"] == 5
        time.sleep(2.5)
        late = watch.check()
        assert late.stages["sink"].messages >= 5 and late.stages["sink"].oldest_s > 2.0
        time.sleep(2.5)
        watch.check()
    finally:
        os.kill(sink["pid"], signal.SIGCONT)
    assert alerts.count("sink") == 1  # once, though it was late at both looks
    # Nothing committed for backlog_stall_s with events waiting: a stuck sink is restarted.
    assert restarts.count("sink") == 1
    wait_for(lambda: "sink" not in watch.check().late(), timeout=60)
    assert "sink" not in watch.alerted  # a later episode alerts again


def test_dead_letters_can_be_listed_and_replayed(settings):
    listing = liverl(settings, "dlq", "list")
    assert listing.returncode == 0 and "unjoinable" in listing.stdout


def test_the_newest_dead_letters_of_a_batch_are_listed(settings, stack):
    """Five dead letters in one producer batch: `liverl dlq` finds the last of them. It read
    the topic up to the end offset the broker answers, which Tansu puts at its last batch's
    base offset + 1, so a poll that returned part of that batch ended the read there; it now
    reads until a poll finds nothing more. (It passed before that too: one poll took the
    whole batch.)"""
    from confluent_kafka import Producer

    from liverl.contracts import DeadLetter

    run = uuid.uuid4().hex[:8]
    producer = Producer({"bootstrap.servers": settings.bootstrap, "linger.ms": 200})
    for i in range(5):
        letter = DeadLetter(event_id=f"dl-{run}-{i}", source_topic=Topics.FEEDBACK, reason="test: one batch",
                            payload="{}")
        producer.produce(Topics.DEAD_LETTER, letter.model_dump_json().encode(), partition=0)
    assert producer.flush(30) == 0
    shown = liverl(settings, "dlq", "show", f"dl-{run}-4")
    assert shown.returncode == 0 and f"dl-{run}-4" in shown.stdout, shown.stdout + shown.stderr


def test_metrics_endpoints_expose_counters_without_secrets(settings, dev_keys):
    for port in (settings.ports.api, settings.ports.gateway, settings.ports.sink):
        text = httpx.get(settings.url(port) + "/metrics/").text
        assert "liverl_" in text
        assert dev_keys["tenant_key"] not in text and dev_keys["admin_key"] not in text
