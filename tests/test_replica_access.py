"""Only liverl's own processes reach a replica: vLLM listens on a unix socket in a 0700
directory, not on a TCP port, so another local user cannot call /collective_rpc (load any
directory as weights) or /v1/completions (bypass the gateway's keys and recording)."""

from __future__ import annotations

import os
import stat
import subprocess

from app.stack import port_free
from liverl.pool import UNIX, read_pool, replica_client
from serving.replicas import sockets_dir

CONNECT = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
try:
    s.connect(sys.argv[1])
except PermissionError:
    sys.exit(13)
sys.exit(0)
"""


def test_replicas_listen_only_on_private_sockets(settings, stack):
    replicas = read_pool(settings).replicas
    assert replicas and all(r.url.startswith(UNIX) for r in replicas)
    directory = sockets_dir(settings)
    assert stat.S_IMODE(directory.stat().st_mode) == 0o700 and directory.stat().st_uid == os.getuid()
    for i in range(len(replicas)):  # nothing on the TCP ports a replica would have used
        assert port_free(settings.host, settings.ports.replica_base + i)
    with replica_client(replicas[0].url) as http:  # liverl itself gets in
        assert http.get("/health").status_code == 200


def test_another_local_user_is_refused(settings, stack):
    socket_path = read_pool(settings).replicas[0].url[len(UNIX):]
    # Debian's interpreter: the venv's lives under /root, which nobody may enter.
    nobody = subprocess.run(["/usr/bin/python3", "-c", CONNECT, socket_path], user=65534, group=65534,
                            capture_output=True, timeout=30)
    assert nobody.returncode == 13, nobody.stderr.decode()
