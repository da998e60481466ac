"""The coding sandbox: honest code scores as a plain run of its tests would; every way of
escaping, exhausting or cheating it is contained and scores zero."""

from __future__ import annotations

import json
import os
import secrets
import socket
import subprocess
import sys
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rollouts.sandbox import (
    Case,
    SandboxLimits,
    SandboxUnavailable,
    Verdict,
    cases_from_asserts,
    run_tests,
)

# Short limits keep the runaway cases quick; honest code needs a fraction of them.
QUICK = SandboxLimits(cpu_s=1, wall_s=2.0)

ADD_TESTS = """\
assert add(1, 2) == 3
assert add(0, 0) == 0
assert add(-4, 7) == 3
"""


def plain_run(solution: str, tests: str) -> int:
    """What an unsandboxed run of the assert lines counts as passed."""
    namespace: dict = {}
    exec(solution, namespace)
    passed = 0
    for line in tests.splitlines():
        try:
            exec(line, namespace)
            passed += 1
        except Exception:
            pass
    return passed


@pytest.mark.parametrize("solution, expected_passed", [
    ("def add(a, b):\n    return a + b\n", 3),
    ("def add(a, b):\n    return a + b if a > 0 else a + b + 1\n", 1),  # wrong for two inputs
    ("def add(a, b):\n    if a < 0:\n        raise ValueError(a)\n    return a + b\n", 2),
    # Prints, imports the standard library, and writes and reads back a file in its directory.
    ("import collections, decimal, fractions, heapq, json, math, re\n"
     "def add(a, b):\n    print('adding', a, b)\n"
     "    with open('scratch.txt', 'w') as f:\n        f.write(str(a + b))\n"
     "    return int(open('scratch.txt').read()) + math.floor(decimal.Decimal(0))\n", 3),
], ids=["correct", "wrong", "raises", "uses-stdlib-and-its-directory"])
def test_honest_code_scores_what_a_plain_run_of_the_tests_scores(solution, expected_passed, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the plain run writes its scratch file here
    verdict = run_tests(solution, cases_from_asserts(ADD_TESTS))
    assert verdict.passed == plain_run(solution, ADD_TESTS) == expected_passed
    assert verdict.total == 3
    assert verdict.reason == ("raised" if "raise" in solution else "ok")


@pytest.mark.parametrize("returned, expected", [
    ("{'a': (1, 2.5), 'b': None, 'c': [True, 'x']}", "{'a': (1, 2.5), 'b': None, 'c': [True, 'x']}"),
    ("{'a': (1, 2.5)}", "{'a': [1, 2.5]}"),  # a tuple is not a list
    ("[1, 2]", "(1, 2)"),
    ("{1: 'a'}", "{'1': 'a'}"),  # nor an int key a string one
    ("{3, 1, 2}", "{1, 2, 3}"), ("frozenset({1})", "{1}"), ("{1, 2}", "[1, 2]"),
    ("b'ab'", "b'ab'"), ("b'ab'", "'ab'"), ("1", "True"), ("1.0", "1"), ("(1, [2, {3: (4,)}])", "(1, [2, {3: (4,)}])"),
])
def test_results_compare_as_a_plain_run_compares_them(returned, expected):
    solution = f"def f():\n    return {returned}\n"
    test = f"assert f() == {expected}\n"
    assert run_tests(solution, cases_from_asserts(test)).passed == plain_run(solution, test)


@pytest.mark.parametrize("solution", [
    "while True:\n    pass\n",
    "def answer():\n    while True:\n        pass\n",
    "import time\ndef answer():\n    time.sleep(60)\n",  # idle, so only the wall clock stops it
], ids=["loop-at-import", "loop-in-the-test", "sleep"])
def test_an_infinite_loop_is_stopped_by_the_time_limits(solution):
    start = time.monotonic()
    verdict = run_tests(solution, [Case("answer()", 1)], QUICK)
    assert (verdict.passed, verdict.reason) == (0, "timeout")
    assert time.monotonic() - start < QUICK.wall_s + 3


@pytest.mark.parametrize("solution", [
    "def answer():\n    return len(bytearray(10**10))\n",
    "hog = []\nwhile True:\n    hog.append(' ' * 10**6)\n",
    "hog = 'x' * 10**9\n",
], ids=["one-allocation", "growing", "one-allocation-at-import"])
def test_a_memory_bomb_runs_out_of_memory_within_its_limit(solution):
    verdict = run_tests(solution, [Case("answer()", 10**10)], QUICK)
    assert verdict.passed == 0
    assert verdict.reason in ("memory", "timeout")  # a slow bomb may reach the CPU limit first


def sandbox_processes() -> list[int]:
    return [int(pid) for pid in os.listdir("/proc") if pid.isdigit() and b"rollouts/sandbox.py"
            in _read(f"/proc/{pid}/cmdline")]


def _read(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError:
        return b""


def test_a_fork_bomb_is_contained_and_leaves_nothing_running():
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    verdict = run_tests(bomb, [Case("answer()", 1)], QUICK)
    assert verdict.passed == 0
    assert sandbox_processes() == []


def test_a_completion_competes_for_the_cpu_as_part_of_its_caller():
    """In the caller's session, so in its autogroup and at its nice: the rollout worker's
    sandboxes yield to production as the worker does, the nice-19 evaluator's stay at 19.
    A session each made every running sandbox a scheduling group of its own, as heavy as
    the production replica (a production user's p99 beside rollouts 83-97 ms, 2.5-3.0x its
    alone; 51-63 ms in its caller's: docs/benchmarks.md, "Harvest on two shared cores")."""
    with ThreadPoolExecutor(1) as running:
        verdict = running.submit(run_tests, "import time\ntime.sleep(1)\ndef f():\n    return 1\n",
                                 [Case("f()", 1)], QUICK)
        deadline = time.monotonic() + 10
        while not (sandboxes := sandbox_processes()) and time.monotonic() < deadline:
            time.sleep(0.01)
        sessions = {os.getsid(pid) for pid in sandboxes}
        groups = {_read(f"/proc/{pid}/autogroup").split(b" nice")[0] for pid in sandboxes}
        assert verdict.result().passed == 1
    assert sandboxes and sessions == {os.getsid(0)}
    assert groups == {_read("/proc/self/autogroup").split(b" nice")[0]}


def test_the_process_limit_binds_even_when_the_caller_is_root():
    counter = textwrap.dedent("""\
        import os, time
        def forks():
            started = 0
            while True:
                try:
                    pid = os.fork()
                except OSError:
                    return started
                if pid == 0:
                    time.sleep(30)
                    os._exit(0)
                started += 1
    """)
    limits = SandboxLimits(max_processes=3)
    assert run_tests(counter, [Case("forks()", limits.max_processes - 1)], limits).passed == 1
    assert sandbox_processes() == []


def test_no_network_not_even_the_hosts_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        listener.setblocking(False)
        port = listener.getsockname()[1]
        solution = textwrap.dedent(f"""\
            import socket
            def reach(host):
                with socket.create_connection((host, {port} if host == '127.0.0.1' else 53), timeout=1) as s:
                    s.sendall(b'x')
                return True
        """)
        verdict = run_tests(solution, [Case("reach('127.0.0.1')", True), Case("reach('1.1.1.1')", True)])
        assert verdict.passed == 0
        with pytest.raises(BlockingIOError):
            listener.accept()


@pytest.mark.parametrize("target", [
    "{host_dir}/escaped", "/tmp/escaped-{token}", "/escaped-{token}", "../escaped-{token}",
    "/dev/shm/escaped-{token}", "/usr/escaped-{token}",
])
def test_a_write_outside_its_directory_fails_and_touches_nothing(tmp_path, target):
    path = target.format(host_dir=tmp_path, token=secrets.token_hex(4))
    solution = f"def write():\n    with open({path!r}, 'w') as f:\n        f.write('x')\n    return True\n"
    assert run_tests(solution, [Case("write()", True)]).passed == 0
    for host_path in (Path(path), tmp_path / "escaped", Path("/escaped")):
        assert not host_path.exists()


def test_root_privileges_are_gone(tmp_path):
    solution = textwrap.dedent("""\
        import ctypes, os
        def chroot():
            os.mkdir('jail'); os.chroot('jail'); return True
        def setuid():
            os.setuid(0); return True
        def mount():
            return ctypes.CDLL(None).mount(b'tmpfs', b'/usr', b'tmpfs', 0, None) == 0
        def chmod():
            os.chmod('/usr', 0o777); return True
    """)
    cases = [Case(f"{name}()", True) for name in ("chroot", "setuid", "mount", "chmod")]
    assert run_tests(solution, cases).passed == 0


def hidden_tests_on_disk(tmp_path: Path) -> tuple[Path, int]:
    """A tests file the way a data set keeps them, with an expected value no one can guess."""
    secret = 10**12 + secrets.randbelow(10**12)
    path = tmp_path / "tests.json"
    path.write_text(json.dumps([{"call": "answer()", "expected": secret}]))
    return path, secret


SNOOPERS = {
    "open-the-tests-file": "def answer():\n    return json.load(open({tests!r}))[0]['expected']\n",
    # Every file the child can see, outside the standard library.
    "search-the-filesystem": textwrap.dedent("""\
        def answer():
            for top, dirs, files in os.walk('/'):
                dirs[:] = [d for d in dirs if os.path.join(top, d) not in ('/usr', sys.prefix, sys.base_prefix)]
                for name in files:
                    try:
                        found = re.search(rb'"expected": (\\d+)', open(os.path.join(top, name), 'rb').read())
                    except OSError:
                        continue
                    if found:
                        return int(found[1])
    """),
    "the-processes-memory": textwrap.dedent("""\
        def answer():
            for o in gc.get_objects():
                for v in (o.values() if isinstance(o, dict) else o if isinstance(o, (list, tuple)) else ()):
                    if type(v) is int and v > 10**12:
                        return v
    """),
    "the-callers-frames": textwrap.dedent("""\
        def answer():
            frame = sys._getframe()
            while frame:
                for v in frame.f_locals.values():
                    if type(v) is int and v > 10**12:
                        return v
                frame = frame.f_back
    """),
    "the-parents-memory-and-environment": textwrap.dedent("""\
        def answer():
            os.environ.update(dict(line.split('=', 1) for line in
                              open(f'/proc/{{os.getppid()}}/environ').read().split('\\0') if '=' in line))
            return int(open(f'/proc/{{os.getppid()}}/mem', 'rb').read(1))
    """),
    "the-harness-source": "def answer():\n"
                          "    return re.search(r'expected.*?(\\d{{13}})', open({harness!r}).read())[1]\n",
}


@pytest.mark.parametrize("snooper", SNOOPERS, ids=list(SNOOPERS))
def test_the_hidden_tests_and_their_expected_values_are_out_of_reach(tmp_path, snooper):
    tests, secret = hidden_tests_on_disk(tmp_path)
    harness = Path(__file__).parents[1] / "rollouts" / "sandbox.py"
    solution = "import gc, json, os, re, sys\n" + SNOOPERS[snooper].format(tests=str(tests), harness=str(harness))
    verdict = run_tests(solution, [Case("answer()", secret)])
    assert verdict.passed == 0


def test_editing_the_tests_changes_nothing(tmp_path):
    tests, secret = hidden_tests_on_disk(tmp_path)
    before = tests.read_text()
    solution = textwrap.dedent(f"""\
        import gc
        try:
            open({str(tests)!r}, 'w').write('[]')
        except OSError:
            pass
        # The child's own copy of the calls: make every test ask for a constant instead.
        for o in gc.get_objects():
            if isinstance(o, list) and o and all(isinstance(c, str) and c.endswith('()') for c in o):
                o[:] = ['1'] * len(o)
        def answer():
            return 0
    """)
    assert run_tests(solution, [Case("answer()", secret), Case("answer()", secret + 1)]).passed == 0
    assert tests.read_text() == before


@pytest.mark.parametrize("exit_call", [
    "sys.exit(0)", "raise SystemExit(0)", "os._exit(0)", "os.kill(os.getpid(), signal.SIGKILL)",
    "os.kill(os.getpid(), signal.SIGTERM)", "os.closerange(3, 64)",
])
@pytest.mark.parametrize("when", ["at-import", "in-the-test"])
def test_exiting_early_scores_zero(exit_call, when):
    code = exit_call if when == "at-import" else f"def answer():\n    {exit_call}\n"
    solution = f"import os, signal, sys\n{code}\ndef unused():\n    pass\n"
    verdict = run_tests(solution, [Case("answer()", 7), Case("answer()", 7)], QUICK)
    assert verdict.passed == 0


TAMPERERS = {
    # Reports a pass for every test on every descriptor the harness could be using.
    "forged-answers": textwrap.dedent("""\
        import os
        for fd in range(3, 20):
            for i in range(10):
                try:
                    os.write(fd, b'{"i": %d, "value": 1}\\n{"ready": true}\\n' % i)
                except OSError:
                    pass
        def answer():
            return 0
    """),
    "protocol-on-stdout": "print('{\"i\": 0, \"value\": 1}')\ndef answer():\n    return 0\n",
    "patched-builtins": textwrap.dedent("""\
        import builtins
        class Anything:
            def __eq__(self, other):
                return True
        builtins.eval = lambda *args, **kwargs: Anything()
        def answer():
            return Anything()
    """),
    "patched-json": textwrap.dedent("""\
        import json
        json.dumps = lambda obj, **kwargs: '{"i": %d, "value": "pass"}' % obj.get('i', 0)
        def answer():
            return 0
    """),
    "patched-harness": textwrap.dedent("""\
        import sys
        harness = sys.modules['__main__']
        harness._write_all = lambda fd, data: None
        harness.json.loads = lambda *a: {'i': 0, 'value': True}
        def answer():
            return True
    """),
    "int-that-equals-anything": textwrap.dedent("""\
        class Equal(int):
            def __eq__(self, other):
                return True
            __hash__ = int.__hash__
        def answer():
            return Equal(0)
    """),
}


@pytest.mark.parametrize("tamperer", TAMPERERS, ids=list(TAMPERERS))
def test_tampering_with_the_runner_or_its_reports_scores_zero(tamperer):
    secret = 10**12 + secrets.randbelow(10**12)
    verdict = run_tests(TAMPERERS[tamperer], [Case("answer()", secret), Case("answer()", secret)], QUICK)
    assert verdict.passed == 0


def test_forged_answers_void_the_whole_run():
    # Answers the first test ahead of the harness on whichever descriptor is the pipe: the
    # forged answer is right, but the harness's own then arrives out of turn. Up to 4096: in
    # the full suite the test process holds so many descriptors that the pipe's is past 63.
    forger = textwrap.dedent("""\
        import os
        for fd in range(3, 4096):
            try:
                os.write(fd, b'{"i": 0, "value": 3}\\n')
            except OSError:
                pass
        def add(a, b):
            return a + b
    """)
    assert run_tests(forger, cases_from_asserts(ADD_TESTS)) == Verdict(0, 3, "tampered")


def test_without_root_a_user_namespace_confines_the_same_way(tmp_path):
    # The caller runs as uid 1000 in a user namespace of its own, as on a developer's laptop.
    escape = tmp_path / "escaped"
    driver = textwrap.dedent(f"""\
        import json, os
        from rollouts.sandbox import Case, cases_from_asserts, run_tests
        verdicts = [os.geteuid(), run_tests("def add(a, b):\\n    return a + b\\n", cases_from_asserts({ADD_TESTS!r}))]
        for attempt in ("open({str(escape)!r}, 'w').write('x')", "os.chroot('/usr')",
                        "assert __import__('ctypes').CDLL(None).mount(b'tmpfs', b'/usr', b'tmpfs', 0, None) == 0",
                        "__import__('socket').create_connection(('127.0.0.1', 22), timeout=1)"):
            verdicts.append(run_tests(f"import os\\ndef escape():\\n    {{attempt}}\\n    return True\\n",
                                      [Case("escape()", True)]))
        print(json.dumps([v if isinstance(v, int) else [v.passed, v.total, v.reason] for v in verdicts]))
    """)
    result = subprocess.run(
        ["unshare", "--user", "--map-user=1000", "--map-group=1000", sys.executable, "-c", driver],
        capture_output=True, text=True, timeout=60, cwd=Path(__file__).parents[1],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])})
    assert result.returncode == 0, result.stderr
    uid, honest, *escapes = json.loads(result.stdout)
    assert uid == 1000
    assert honest == [3, 3, "ok"]
    assert all(passed == 0 for passed, _, _ in escapes)
    assert not escape.exists()


def test_no_sandbox_means_an_error_not_an_unconfined_run(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxUnavailable):
        run_tests("def add(a, b):\n    return a + b\n", cases_from_asserts(ADD_TESTS))


def test_tests_are_call_and_value_pairs():
    assert cases_from_asserts("assert f(1, 'x') == [1, 'x']\n") == [Case("f(1, 'x')", [1, "x"])]
    assert run_tests("def f():\n    return 1\n", []).reason == "no tests"
    with pytest.raises(ValueError):
        cases_from_asserts("assert f(1) > 0\n")
