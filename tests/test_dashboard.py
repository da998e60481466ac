"""The on-call dashboard in a real headless browser (Debian's chromium through its
chromedriver, installed by install.sh) against the shared stack: a tenant key is turned
away, an admin key logs in, the plots are drawn from judged production traffic, and a
rollback clicked in the page is verified serving on every replica."""

from __future__ import annotations

import shutil
from pathlib import Path

import httpx
import pytest
from helpers import serve_and_judge
from test_operations import promote_copy

from liverl.audit import AuditLog
from liverl.contracts import CapacityEvent
from liverl.keys import KeyStore, admin_headers, admin_key
from liverl.lending import events_file, read_pause, record_event, set_pause
from liverl.pool import read_pool
from policies.registry import Registry
from promotion.dashboard import rates_figure

SCREENSHOT = Path(__file__).parents[1] / "docs" / "dashboard.png"


@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    driver_path, chromium = shutil.which("chromedriver"), shutil.which("chromium")
    if not driver_path or not chromium:
        pytest.skip("Debian's chromium and chromium-driver are not installed (install.sh installs them as root)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--window-size=1400,1250"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(driver_path), options=options)  # a given driver: nothing downloaded
    yield driver
    driver.quit()


def test_a_tenant_key_never_sees_the_dashboard(settings, dev_keys, stack):
    base = settings.url(settings.ports.controller)
    tenant = {"Authorization": f"Bearer {dev_keys['tenant_key']}"}
    for path in ("/dashboard", "/dashboard/state", "/dashboard/plots/rates.svg"):
        assert httpx.get(base + path, headers=tenant, timeout=30).status_code == 403, path
    login = httpx.post(base + "/dashboard/login", data={"key": dev_keys["tenant_key"]}, timeout=30)
    assert login.status_code == 403 and "admin key" in login.text and "set-cookie" not in login.headers
    assert httpx.get(base + "/dashboard/state", cookies={"liverl_session": "forged"}, timeout=30).status_code == 401


def test_the_newest_figures_are_drawn_inside_the_plot():
    """The bucket still open (the last minute of an incident, the one on-call looks for)
    sits inside the plot, at the middle of what it covers so far, not past its right edge."""
    now, bucket_s = 1_800_000_000.0, 45
    row = {"policy_version": "v1", "tenant": "t", "judged": 4, "accepted": 3, "samples": 4, "reward_sum": 3.0,
           "reward_squares": 3.0}
    rows = [row | {"bucket": int(now) - 5}, row | {"bucket": int(now) - 5 - bucket_s}]
    figure = rates_figure(rows, bucket_s, 30, now)
    for axes in figure.axes:
        (line,) = [line for line in axes.lines if line.get_gid() in ("accept-v1", "reward-v1")]
        left, right = axes.get_xlim()
        assert all(left <= x <= right for x in line.get_xdata()), (line.get_gid(), list(line.get_xdata()))
        assert list(line.get_xdata()) == [-(bucket_s + 5 - bucket_s / 2) / 60, -2.5 / 60]


def test_the_dashboard_shows_lending_and_pauses_it_through_the_controller(settings, dev_keys, stack):
    """On-call sees on the dashboard what `liverl capacity status` says (who paused lending
    and why, the replicas lent and taken back lately) and can pause it from there: the
    controller's door writes the same pause, audited, for the operator's key."""
    controller = settings.url(settings.ports.controller)
    kept = events_file(settings).read_text() if events_file(settings).exists() else None
    take_back = CapacityEvent(action="take_back", replica="replica-1", policy_version="v3", load=2.0,
                              why="load 2.00 per production replica, above take_back_above 1.0", seconds=0.4)

    def lending() -> dict:
        return httpx.get(controller + "/dashboard/state", headers=admin_headers(settings), timeout=30).json()["lending"]

    try:
        record_event(settings, take_back)
        with open(events_file(settings), "a") as out:
            out.write('{"event_id": "cap-torn", "action": "le')  # a scheduler killed mid-write
        assert lending()["events"][-1]["why"] == take_back.why and lending()["events"][-1]["seconds"] == 0.4
        tenant = {"Authorization": f"Bearer {dev_keys['tenant_key']}"}
        assert httpx.post(controller + "/admin/capacity/pause", headers=tenant, json={"reason": "x"},
                          timeout=30).status_code == 403
        assert httpx.post(controller + "/admin/capacity/pause", headers=admin_headers(settings), json={"reason": ""},
                          timeout=30).status_code == 422
        paused = httpx.post(controller + "/admin/capacity/pause", headers=admin_headers(settings),
                            json={"reason": "incident 7: hold rollouts"}, timeout=60)
        assert paused.status_code == 200 and paused.json() == {"paused": True, "lent": []}, paused.text
        shown = lending()
        assert shown["paused"]["reason"] == "incident 7: hold rollouts" and not shown["scheduler"]
        assert shown["paused"]["actor"] == KeyStore(settings.keys_file).authenticate(admin_key(settings)).key_id
        entry = AuditLog(settings.audit_file).entries(1, "capacity.pause")[0]
        assert entry.actor == shown["paused"]["actor"] and entry.reason == "incident 7: hold rollouts"
        resumed = httpx.post(controller + "/admin/capacity/resume", headers=admin_headers(settings),
                             json={"reason": "incident 7 over"}, timeout=30)
        assert resumed.json() == {"paused": False, "lent": []} and lending()["paused"] is None
    finally:
        set_pause(settings, None)
        if kept is None:
            events_file(settings).unlink(missing_ok=True)
        else:
            events_file(settings).write_text(kept)


def test_on_call_logs_in_reads_live_plots_and_rolls_back_from_the_page(
        settings, dev_keys, stack, paused_learner, browser):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as seen
    from selenium.webdriver.support.ui import WebDriverWait

    registry = Registry(settings.policies_dir)
    before = serve_and_judge(settings, dev_keys["tenant_key"], 12)
    controller = settings.url(settings.ports.controller)
    promoted = promote_copy(settings, "dashboard", "a stable to roll back from in the page")
    assert promoted.status_code == 200 and promoted.json()["state"] == "stable", promoted.text
    candidate = promoted.json()["version"]
    assert serve_and_judge(settings, dev_keys["tenant_key"], 12) == candidate
    wait = WebDriverWait(browser, 60)

    browser.get(controller + "/dashboard")
    wait.until(seen.presence_of_element_located((By.ID, "key"))).send_keys(dev_keys["tenant_key"])
    browser.find_element(By.ID, "login").click()
    assert "admin key" in wait.until(seen.presence_of_element_located((By.ID, "login-error"))).text

    browser.find_element(By.ID, "key").send_keys(admin_key(settings))
    browser.find_element(By.ID, "login").click()
    wait.until(seen.presence_of_element_located((By.ID, "versions")))  # the dashboard, not the login page
    wait.until(seen.text_to_be_present_in_element((By.ID, "lending"), "off: the capacity scheduler is not running"))
    try:  # lending paused and resumed from the page, and drawn as it changes
        browser.find_element(By.ID, "reason").send_keys("a launch at noon")
        browser.find_element(By.ID, "pause-lending").click()
        wait.until(seen.text_to_be_present_in_element((By.ID, "message"), "lending paused, lent: none"))
        wait.until(seen.text_to_be_present_in_element((By.ID, "lending"), "a launch at noon"))
        assert read_pause(settings).reason == "a launch at noon"
        assert not browser.find_element(By.ID, "pause-lending").is_displayed()
        browser.find_element(By.ID, "reason").send_keys("the launch went well")
        browser.find_element(By.ID, "resume-lending").click()
        wait.until(seen.text_to_be_present_in_element((By.ID, "lending"), "off: the capacity scheduler is not running"))
        assert read_pause(settings) is None
    finally:
        set_pause(settings, None)
    # Both versions' curves, drawn from their judged completions once the reward window closes.
    for version in (before, candidate):
        WebDriverWait(browser, 90, poll_frequency=2).until(
            lambda b, v=version: b.find_elements(By.CSS_SELECTOR, f'#rates svg g[id="accept-{v}"]')
            or b.execute_script("typeof refreshPlot === 'function' && refreshPlot()"))  # script may still load
    assert candidate in browser.execute_script("return document.querySelector('#rates').textContent")
    refreshed = WebDriverWait(browser, 60, ignored_exceptions=[StaleElementReferenceException])
    refreshed.until(lambda b: any(row.text.startswith(f"{candidate} stable")
                                  for row in b.find_elements(By.CSS_SELECTOR, "#versions tbody tr")))

    # The page's session cannot be replayed without its CSRF token (another site's form).
    cookie = browser.get_cookie("liverl_session")["value"]
    forged = httpx.post(controller + "/admin/rollback", json={"reason": "from another site"},
                        cookies={"liverl_session": cookie}, timeout=30)
    assert forged.status_code == 403 and "CSRF" in forged.text

    browser.find_element(By.ID, "rollback").click()  # no reason yet: refused in the page
    assert "reason is required" in browser.find_element(By.ID, "message").text
    browser.find_element(By.ID, "reason").send_keys("dashboard test: users complain")
    browser.find_element(By.ID, "rollback").click()
    WebDriverWait(browser, 600).until(seen.text_to_be_present_in_element((By.ID, "message"), "rollback done"))
    assert {r.policy_version for r in read_pool(settings).replicas} == {before}
    assert registry.get(candidate).state == "rolled_back"
    assert registry.history(candidate)[-1]["reason"] == "dashboard test: users complain"
    wait.until(seen.text_to_be_present_in_element((By.ID, "history"), "dashboard test: users complain"))
    SCREENSHOT.parent.mkdir(exist_ok=True)
    browser.save_screenshot(str(SCREENSHOT))
    browser.find_element(By.CSS_SELECTOR, "form[action='/dashboard/logout'] button").click()
    wait.until(seen.presence_of_element_located((By.ID, "key")))  # back at the login
    browser.get(controller + "/dashboard")
    assert browser.find_elements(By.ID, "key") and not browser.find_elements(By.ID, "versions")
