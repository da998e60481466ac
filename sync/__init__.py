"""Lossless policy deltas: encode version A -> B, ship through a delta store, apply bit for bit.

    from sync import encode_delta, apply_delta
    encode_delta(old_tensors, new_tensors, "v2.delta", base_version="v1", target_version="v2")
    new_tensors = apply_delta(old_tensors, "v2.delta", expected_base="v1")

See `sync.delta` for the file format, `sync.codec` for the coding of one tensor's change
and `sync.store` for the local and S3 delta stores.
"""

from sync.checkpoint import Checkpoint
from sync.delta import (
    BaseMismatchError,
    CorruptDeltaError,
    DeltaError,
    DeltaManifest,
    TensorEntry,
    TruncatedDeltaError,
    apply_delta,
    apply_delta_dir,
    encode_delta,
    iter_apply,
    read_manifest,
    state_digest,
    tensor_hash,
)

__all__ = [
    "BaseMismatchError", "Checkpoint", "CorruptDeltaError", "DeltaError", "DeltaManifest",
    "TensorEntry", "TruncatedDeltaError", "apply_delta", "apply_delta_dir", "encode_delta",
    "iter_apply", "read_manifest", "state_digest", "tensor_hash",
]
