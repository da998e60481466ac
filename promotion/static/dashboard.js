// The on-call dashboard: reads /dashboard/state and the plot every few seconds and calls
// the admin API for changes. Text from the server goes in with textContent only (reasons
// are free text). Every change carries the session's CSRF token and a reason.
"use strict";

const csrf = document.querySelector('meta[name="csrf-token"]').content;
const csrfHeader = document.querySelector('meta[name="csrf-header"]').content;
const $ = (selector) => document.querySelector(selector);

function when(t) {
  return t ? new Date(t * 1000).toLocaleString() : "";
}

function row(cells, classes = {}) {
  const tr = document.createElement("tr");
  for (const [i, value] of cells.entries()) {
    const td = document.createElement("td");
    if (value instanceof Node) td.append(value); else td.textContent = value ?? "";
    if (classes[i]) td.className = classes[i];
    tr.append(td);
  }
  return tr;
}

function fill(selector, rows) {
  $(selector + " tbody").replaceChildren(...rows);
}

async function get(url) {
  const response = await fetch(url, { credentials: "same-origin" });
  if (response.status === 401) window.location = "/dashboard/login";
  if (!response.ok) throw new Error(`${url}: ${response.status}`);
  return response;
}

function actionButton(label, action, version) {
  const button = document.createElement("button");
  button.textContent = label;
  button.dataset.action = action;
  button.dataset.version = version;
  button.id = `${action}-${version}`;
  return button;
}

function render(state) {
  const c = state.controller;
  $("#controller-state").textContent = `controller: ${c.state}` + (c.last_error ? ` (last error: ${c.last_error})` : "");
  const aliases = Object.entries(state.serving.aliases).map(([a, v]) => `${a} → ${v}`).join(", ");
  const canary = state.serving.aliases.canary ? ` (canary share ${Math.round(state.serving.canary_share * 100)}% of sessions)` : "";
  const pinned = c.pinned ? ` · stable pinned by ${c.pinned.actor}: ${c.pinned.reason}` : "";
  $("#aliases").textContent = (aliases || "no aliases") + canary + pinned;
  fill("#replicas", state.serving.replicas.map((r) =>
    row([r.name, r.version,
         r.alias === "rollout" ? (r.enabled ? "lent to rollouts" : "lent; being taken back")
           : !r.enabled ? "no (swapping)" : r.alias ? `only alias ${r.alias}` : "yes",
         r.in_sync ? "yes" : "no"])));
  const lending = state.lending.error ? { paused: null, lent: [], events: [] } : state.lending;
  const pause = lending.paused;
  $("#lending").textContent = state.lending.error ?? ((pause
    ? `paused by ${pause.actor} at ${new Date(pause.at).toLocaleString()}: ${pause.reason}`
    : lending.scheduler ? "on (when production's load allows)" : "off: the capacity scheduler is not running")
    + ` · lent: ${lending.lent.join(", ") || "none"}`);
  $("#lending").className = pause || state.lending.error ? "error" : "";
  $("#lending-events").hidden = !lending.events.length;
  $("#pause-lending").hidden = Boolean(pause);
  $("#resume-lending").hidden = !pause;
  $("#lending-events").replaceChildren(...lending.events.slice().reverse().map((e) => {
    const li = document.createElement("li");
    li.textContent = `${new Date(e.timestamp).toLocaleTimeString()} ${e.replica} ${e.action === "lend" ? "lent" : "taken back"}`
      + ` (serving ${e.policy_version}) in ${e.seconds.toFixed(2)} s` + (e.error ? `, failed: ${e.error}` : "") + ` · ${e.why}`;
    return li;
  }));
  const learner = state.learner;
  const learnerRows = learner.error ? [["status", learner.error]] : [
    ["version", learner.version], ["versions ahead of stable", learner.versions_ahead_of_stable],
    ["pending samples", learner.pending], ["paused", learner.paused ? "yes" : "no"],
    ["dropped since last version", JSON.stringify(learner.dropped_since_last_version)]];
  fill("#learner", learnerRows.map((r) => row(r, { 1: "wrap" })));
  const backlog = state.backlog;  // the supervisor's backlog watch
  fill("#backlog", backlog ? Object.entries(backlog.stages).map(([stage, b]) => row([
    stage, b ? b.messages.toLocaleString() : "unknown (broker not answering)",
    b && b.oldest_s != null ? `${b.oldest_s.toFixed(1)} s` : "", `${backlog.measured_s_ago.toFixed(0)} s ago`],
    { 2: backlog.late.includes(stage) ? "error" : "" })) : [row(["not measured yet (no supervisor?)"])]);
  fill("#versions", state.versions.map((v) => {
    const buttons = document.createElement("span");
    if (v.state === "candidate" || v.state === "canary") buttons.append(actionButton("Promote", "promote", v.version));
    if (v.state === "canary") buttons.append(actionButton("Abort", "abort", v.version));
    return row([v.version, v.state, v.parent, when(v.created_at), v.gate == null ? "" : (v.gate ? "passed" : "failed"),
                v.verdict, v.skill, buttons], { 1: `state-${v.state}` });
  }));
  const to = $("#rollback-to");
  const chosen = to.value;
  const earlier = state.versions.filter((v) => v.state === "superseded" || v.state === "stable");
  to.replaceChildren(new Option("previous stable", ""), ...earlier.filter((v) => v.state !== "stable")
    .map((v) => new Option(v.version, v.version)));
  to.value = chosen;
  fill("#history", state.history.map((h) =>
    row([when(h.at), h.version, h.from, h.to, h.actor, h.reason], { 5: "reason" })));
  fill("#audit", state.audit.map((e) => row([when(e.at), e.actor, e.action, e.target, e.reason], { 4: "reason" })));
  $("#refreshed").textContent = `refreshed ${new Date().toLocaleTimeString()}`;
}

async function refresh() {
  try {
    render(await (await get("/dashboard/state")).json());
  } catch (error) {
    $("#refreshed").textContent = `refresh failed: ${error.message}`;
  }
}

async function refreshPlot() {
  try {
    const svg = await (await get(`/dashboard/plots/rates.svg?minutes=${$("#minutes").value}`)).text();
    $("#rates").innerHTML = svg; // drawn by the server from ClickHouse's figures, no user text in it
  } catch (error) {
    $("#rates").textContent = `plot failed: ${error.message}`;
  }
}

const routes = {
  promote: (v) => [`/admin/policies/${v}/promote`, {}],
  abort: (v) => [`/admin/policies/${v}/abort`, {}],
  pin: () => ["/admin/pin", {}],
  unpin: () => ["/admin/unpin", {}],
  rollback: () => ["/admin/rollback", { to: $("#rollback-to").value || null }],
  pauseLending: () => ["/admin/capacity/pause", {}],
  resumeLending: () => ["/admin/capacity/resume", {}],
};

async function act(action, version) {
  const message = $("#message");
  const reason = $("#reason").value.trim();
  if (!reason) {
    message.className = "error";
    message.textContent = "a reason is required: write it in the box above first";
    return;
  }
  const [url, body] = routes[action](version);
  message.className = "";
  message.textContent = `${action} ${version ?? ""}: working (a swap waits until every replica is verified)…`;
  const response = await fetch(url, {
    method: "POST", credentials: "same-origin",
    headers: { "Content-Type": "application/json", [csrfHeader]: csrf },
    body: JSON.stringify({ ...body, reason }),
  });
  const answer = await response.json().catch(() => ({}));
  if (response.ok) {
    message.className = "ok";
    message.textContent = `${action} done: ` + ("paused" in answer
      ? `lending ${answer.paused ? "paused" : "resumed"}, lent: ${answer.lent.join(", ") || "none"}`
      : `${answer.version ?? ""} ${answer.state ?? (answer.pinned ? "pinned" : "")}`);
    $("#reason").value = "";
  } else {
    message.className = "error";
    message.textContent = `${action} refused (${response.status}): ${JSON.stringify(answer.detail ?? answer)}`;
  }
  refresh();
  refreshPlot();
}

document.addEventListener("click", (event) => {
  const button = event.target.closest("button[data-action]");
  if (button) act(button.dataset.action, button.dataset.version);
});
$("#minutes").addEventListener("change", refreshPlot);
refresh();
refreshPlot();
setInterval(refresh, 3000);
setInterval(refreshPlot, 10000);
