"""Scores a Python completion against hidden unit tests without trusting anything it says.

A test is a call expression and the value it must return (`Case`). The trusted side, this
process, holds the expected values; the completion runs in a child process that evaluates
each call and sends back the result as JSON on a pipe of its own, and this side compares.
Expected values never enter the child, so nothing the completion does to its own process
(patched asserts or runner, forged reports, an early exit) can turn a wrong answer into a
pass: it can only ever send values it computed.

The child is confined (docs/sandbox.md): its own pid, network, mount, IPC and UTS
namespaces; chrooted into a tmpfs that shows the standard library and system libraries
read-only and one small writable throwaway directory; an unprivileged uid that no other
process has (so the process limit binds even when the caller is root); CPU-time, memory,
process, file-size and wall-time limits. Killing its pid namespace's init ends every process
it started.
"""

from __future__ import annotations

# This file is also the child's program (`python -I -S sandbox.py ANSWER_FD`, inside fresh
# namespaces, root there until _confine drops it). The child's half comes first and the
# script ends with it, so the child never pays for the caller's imports (a third of its start).
import ctypes
import json
import os
import resource
import signal
import sys

_MS_RDONLY, _MS_NOSUID, _MS_NODEV, _MS_REMOUNT, _MS_BIND, _MS_REC = 1, 2, 4, 32, 4096, 16384
_MS_ATIME_FLAGS = 1024 | 2048 | 4096  # noatime, nodiratime, relatime: kept as they are
_PR_SET_PDEATHSIG, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 1, 24, 38
_NEW_ROOT = "/tmp"  # any existing directory; the mount namespace hides the host's /tmp
_WORK_DIR = "/work"


def _child_main(answer_fd: int) -> None:
    payload = json.loads(sys.stdin.buffer.read())
    try:
        _confine(payload["limits"], payload["uid"])
    except OSError as error:
        _send(answer_fd, {"setup_error": str(error)})
        return
    # Nothing the completion prints may reach the parent but through the answer pipe.
    devnull = os.open("/dev/null", os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    _send(answer_fd, {"ready": True})
    namespace: dict = {"__name__": "solution"}
    try:
        exec(compile(payload["solution"], "solution.py", "exec"), namespace)
        load_error = None
    except Exception as error:
        load_error = type(error).__name__
    for index, call in enumerate(payload["calls"]):
        try:
            if load_error:
                answer = {"i": index, "error": load_error}
            else:
                answer = {"i": index, "value": _tagged(eval(call, namespace))}
            line = json.dumps(answer)
        except Exception as error:
            line = json.dumps({"i": index, "error": type(error).__name__})
        _write_all(answer_fd, line.encode() + b"\n")


def _tagged(value: Any) -> Any:
    """A result as JSON that keeps what `==` tells apart: tuples, sets, dict keys and bytes
    are tagged ({"t": [...]}), so a tuple does not pass for a list (`_untagged` reverses it)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, list):
        return [_tagged(v) for v in value]
    if isinstance(value, tuple):
        return {"t": [_tagged(v) for v in value]}
    if isinstance(value, (set, frozenset)):
        return {"s": [_tagged(v) for v in value]}
    if isinstance(value, dict):
        return {"d": [[_tagged(k), _tagged(v)] for k, v in value.items()]}
    if isinstance(value, bytes):
        return {"b": value.hex()}
    raise TypeError(f"a test result of type {type(value).__name__} cannot be compared")


def _untagged(data: Any) -> Any:
    """Plain Python data from `_tagged`'s JSON; ValueError or TypeError if it is not that."""
    if isinstance(data, list):
        return [_untagged(v) for v in data]
    if not isinstance(data, dict):
        return data
    if len(data) != 1:
        raise ValueError("not a tagged value")
    (tag, inner), = data.items()
    if tag == "b" and isinstance(inner, str):
        return bytes.fromhex(inner)
    if not isinstance(inner, list):
        raise ValueError("not a tagged value")
    if tag == "t":
        return tuple(_untagged(v) for v in inner)
    if tag == "s":
        return frozenset(_untagged(v) for v in inner)
    if tag == "d":
        return {_untagged(k): _untagged(v) for k, v in inner}
    raise ValueError(f"unknown tag {tag!r}")


def _send(fd: int, message: dict) -> None:
    _write_all(fd, json.dumps(message).encode() + b"\n")


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def _confine(limits: dict, uid: int | None) -> None:
    libc = ctypes.CDLL(None, use_errno=True)

    def mount(source: str | None, target: str, fstype: str | None, flags: int, options: str | None = None) -> None:
        encoded = [None if arg is None else arg.encode() for arg in (source, target, fstype, options)]
        if libc.mount(encoded[0], encoded[1], encoded[2], ctypes.c_ulong(flags), encoded[3]) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, f"mount {source} on {target}: {os.strerror(errno)}")

    def expose(path: str, device: bool = False) -> None:
        """Binds a host path at the same place in the new root, read-only."""
        target = _NEW_ROOT + path
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "w").close()
        mount(path, target, None, _MS_BIND | _MS_REC)
        kept = os.statvfs(path).f_flag & _MS_ATIME_FLAGS  # a user namespace may not change these
        mount(None, target, None, _MS_REMOUNT | _MS_BIND | _MS_RDONLY | _MS_NOSUID | kept
              | (0 if device else _MS_NODEV))

    mount("tmpfs", _NEW_ROOT, "tmpfs", _MS_NOSUID | _MS_NODEV, "size=1m,mode=0755")
    stdlib = os.path.dirname(os.__file__)
    # The standard library, and the system libraries its extension modules link against.
    for path in ["/usr"] + ([] if stdlib.startswith("/usr/") else [stdlib]):
        expose(path)
    site_packages = os.path.join(stdlib, "site-packages")
    if os.path.isdir(site_packages):  # installed packages (and any data sets in them) stay hidden
        mount("tmpfs", _NEW_ROOT + site_packages, "tmpfs", _MS_RDONLY | _MS_NOSUID | _MS_NODEV, "size=4k")
    for link in ("/bin", "/lib", "/lib64"):  # usr-merged systems: links into /usr
        if os.path.islink(link):
            os.symlink(os.readlink(link), _NEW_ROOT + link)
        elif os.path.isdir(link):
            expose(link)
    for device in ("/dev/null", "/dev/urandom"):
        expose(device, device=True)
    owner = uid if uid is not None else 0
    os.mkdir(_NEW_ROOT + _WORK_DIR)
    mount("tmpfs", _NEW_ROOT + _WORK_DIR, "tmpfs", _MS_NOSUID | _MS_NODEV,
          f"size={limits['disk_mb']}m,mode=0700,uid={owner},gid={owner}")
    mount(None, _NEW_ROOT, None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    os.chroot(_NEW_ROOT)
    os.chdir(_WORK_DIR)

    disk = limits["disk_mb"] << 20
    for limit, value in ((resource.RLIMIT_AS, limits["memory_mb"] << 20), (resource.RLIMIT_CPU, limits["cpu_s"]),
                         (resource.RLIMIT_NPROC, limits["max_processes"]), (resource.RLIMIT_FSIZE, disk),
                         (resource.RLIMIT_NOFILE, 64), (resource.RLIMIT_CORE, 0)):
        resource.setrlimit(limit, (value, value))

    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)  # leaving uid 0 clears every capability
    else:
        _drop_capabilities(libc)
    # No setuid binary or file capability can give any of it back.
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    # Changing uid cleared the death signal unshare --kill-child had set; set it again.
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def _drop_capabilities(libc: ctypes.CDLL) -> None:
    """Namespace root keeps its uid but loses every capability, now and across exec."""
    cap = 0
    while libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0) == 0:  # fails past the kernel's last
        cap += 1

    class Header(ctypes.Structure):
        _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

    class Data(ctypes.Structure):
        _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                    ("inheritable", ctypes.c_uint32)]

    linux_capability_version_3 = 0x20080522
    if libc.capset(ctypes.byref(Header(linux_capability_version_3, 0)), (Data * 2)()) != 0:
        raise OSError(ctypes.get_errno(), "capset")


if __name__ == "__main__":
    _child_main(int(sys.argv[1]))
    sys.exit()

import ast  # noqa: E402
import secrets  # noqa: E402
import select  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from dataclasses import asdict, dataclass  # noqa: E402
from typing import Any  # noqa: E402


@dataclass(frozen=True)
class SandboxLimits:
    """What one completion may use, for all its tests together."""

    cpu_s: int = 2
    wall_s: float = 5.0  # counted from the moment the sandbox is ready, not from spawning
    memory_mb: int = 256  # address space; the interpreter itself needs about 30 MB
    max_processes: int = 4  # the child included
    disk_mb: int = 16  # the throwaway directory, and the largest file it may write
    answer_bytes: int = 1 << 20  # one test's result as JSON


@dataclass(frozen=True)
class Case:
    """One hidden test: `call` (an expression over the completion's names) must return `expected`."""

    call: str
    expected: Any

    def __post_init__(self) -> None:
        # Held as results come back over the pipe (tagged JSON, decoded): plain data the
        # completion's objects never touch, and only data a test can compare with `==`.
        object.__setattr__(self, "expected", _untagged(json.loads(json.dumps(_tagged(self.expected)))))


@dataclass(frozen=True)
class Verdict:
    """`passed` of `total` tests; `reason` says how the run ended.

    "ok": every test ran; "raised": some test raised; "memory": some test ran out of memory;
    "timeout": the CPU or wall limit ended it; "crashed": the child ended before answering
    every test (an exit, a fatal signal); "answer too large": a result over the limit;
    "tampered": the child broke the protocol (its whole run scores zero); "no tests".
    """

    passed: int
    total: int
    reason: str

    @property
    def score(self) -> float:
        return self.passed / self.total if self.total else 0.0


class SandboxUnavailable(RuntimeError):
    """The sandbox could not be set up here; nothing was run unconfined."""


def cases_from_asserts(text: str) -> list[Case]:
    """Tests written as `assert CALL == LITERAL` lines, the shape HumanEval-style checks use."""
    cases = []
    for statement in ast.parse(text).body:
        test = statement.test if isinstance(statement, ast.Assert) else None
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            raise ValueError(f"not an `assert CALL == VALUE` test: {ast.unparse(statement)}")
        cases.append(Case(ast.unparse(test.left), ast.literal_eval(test.comparators[0])))
    return cases


def run_tests(solution: str, cases: Sequence[Case], limits: SandboxLimits = SandboxLimits()) -> Verdict:
    """Runs `solution` (Python source) in the sandbox and counts the `cases` it passes."""
    if not cases:
        return Verdict(0, 0, "no tests")
    unshare = shutil.which("unshare")
    if unshare is None:
        raise SandboxUnavailable("util-linux `unshare` is not installed; refusing to run unconfined")
    namespaces = ["--pid", "--fork", "--kill-child", "--net", "--mount", "--ipc", "--uts"]
    if os.geteuid() == 0:
        # A fresh uid of its own: root ignores the process limit, and a uid shared with
        # other sandboxes would share their process count.
        uid = 1_000_000 + secrets.randbelow(1 << 30)
    else:
        # Without root the child cannot take another uid; a user namespace lets it set up its
        # mounts as namespace root, after which it drops every capability.
        namespaces += ["--user", "--map-root-user"]
        uid = None
    payload = {"solution": solution, "calls": [case.call for case in cases], "limits": asdict(limits), "uid": uid}
    answers_out, answers_in = os.pipe()
    # The child reads its work from an unnamed file, so a large one never blocks on a pipe.
    with tempfile.TemporaryFile() as work:
        work.write(json.dumps(payload).encode())
        work.seek(0)
        try:
            child = subprocess.Popen(
                [unshare, *namespaces, sys.executable, "-I", "-S", __file__, str(answers_in)],
                stdin=work, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, pass_fds=(answers_in,),
                # A process group of its own (for killpg) in the caller's session: a session
                # of its own would be a CPU autogroup of its own, as heavy as a replica.
                env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}, process_group=0)
        finally:
            os.close(answers_in)
    try:
        return _score(child, _Answers(answers_out, limits.answer_bytes), cases, limits)
    finally:
        os.close(answers_out)
        _kill(child)
        assert child.stderr is not None, "started with stderr=PIPE"
        child.stderr.close()


_TIMEOUT, _EOF, _TOO_LONG = "timeout", "eof", "too long"
_STARTUP_S = 30.0  # generous: a loaded machine may take seconds to start an interpreter


class _Answers:
    """Lines from the child's answer pipe, each bounded in size, each awaited until a deadline."""

    def __init__(self, fd: int, line_limit: int):
        self._fd, self._line_limit, self._buffer = fd, line_limit, b""
        self._poll = select.poll()  # not select(): a busy worker's fds may pass 1024
        self._poll.register(fd, select.POLLIN)

    def line(self, deadline: float) -> bytes | str:
        while b"\n" not in self._buffer:
            if len(self._buffer) > self._line_limit:
                return _TOO_LONG
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._poll.poll(remaining * 1000):
                return _TIMEOUT
            chunk = os.read(self._fd, 1 << 16)
            if not chunk:
                return _EOF
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return _TOO_LONG if len(line) > self._line_limit else line


def _score(child: subprocess.Popen, answers: _Answers, cases: Sequence[Case], limits: SandboxLimits) -> Verdict:
    ready = answers.line(time.monotonic() + _STARTUP_S)
    if ready != b'{"ready": true}':
        _kill(child)
        assert child.stderr is not None, "started with stderr=PIPE"
        stderr = child.stderr.read(4096).decode(errors='replace')
        raise SandboxUnavailable(f"the sandbox did not start ({ready!r}): {stderr}")
    deadline = time.monotonic() + limits.wall_s
    passed, errors = 0, set()
    for index, case in enumerate(cases):
        line = answers.line(deadline)
        if line == _EOF:
            return Verdict(passed, len(cases), "timeout" if _killed_by_cpu_limit(child, limits) else "crashed")
        if isinstance(line, str):  # _TIMEOUT or _TOO_LONG
            return Verdict(passed, len(cases), "answer too large" if line == _TOO_LONG else "timeout")
        answer = _answer(line, index)
        if answer is None:
            return Verdict(0, len(cases), "tampered")
        if "error" in answer:
            errors.add(answer["error"])
        # Both sides are decoded plain data here: no object of the child's can fake ==.
        elif answer["value"] == case.expected:
            passed += 1
    return Verdict(passed, len(cases), "memory" if "MemoryError" in errors else "raised" if errors else "ok")


def _answer(line: bytes, index: int) -> dict | None:
    """The child's answer to test `index`, or None when it is anything but that."""
    try:
        answer = json.loads(line)
    except (ValueError, RecursionError):
        return None
    if not isinstance(answer, dict) or type(answer.get("i")) is not int or answer["i"] != index:
        return None
    if answer.keys() == {"i", "value"}:
        try:
            return {"i": index, "value": _untagged(answer["value"])}
        except (ValueError, TypeError, RecursionError):  # nothing honest code returns decodes so
            return None
    if answer.keys() == {"i", "error"} and isinstance(answer["error"], str):
        return answer
    return None


def _killed_by_cpu_limit(child: subprocess.Popen, limits: SandboxLimits) -> bool:
    """Whether the completion used up its CPU time. unshare does not say how its init died
    (util-linux's exits 1 when a signal ended it), but reaping unshare with wait4 gives the
    CPU time of unshare and of every process it reaped: the completion's."""
    deadline = time.monotonic() + 5
    while (reaped := os.wait4(child.pid, os.WNOHANG))[0] == 0:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    _, status, usage = reaped
    child.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
    return usage.ru_utime + usage.ru_stime >= limits.cpu_s - 0.05


def _kill(child: subprocess.Popen) -> None:
    # Killing the namespace's init kills every process in it, and unshare, which waits for
    # init, exits only once they are all gone: so kill init and wait for unshare, and every
    # process of the completion's is gone when this returns. Once unshare is reaped its id
    # may be reused, so nothing is signalled after that.
    if child.returncode is not None:
        return
    for init in _read_text(f"/proc/{child.pid}/task/{child.pid}/children").split():
        try:
            os.kill(int(init), signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        child.wait(timeout=5)
    except subprocess.TimeoutExpired:  # unshare had not started init yet, or is stuck
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def _read_text(path: str) -> str:
    try:
        with open(path) as file:
            return file.read()
    except OSError:
        return ""
