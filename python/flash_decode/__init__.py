"""flash_decode: flash decoding (split-KV attention plus an LSE combine) for
NVIDIA GPUs, a Go core driven from PyTorch.

    >>> import torch, flash_decode
    >>> out = flash_decode.flash_decode(q, k_cache, v_cache, cache_seqlens=lens)  # doctest: +SKIP

Importing this package never loads the native (Go) extension: that happens on
the first call, once a usable CUDA driver has been confirmed.
"""

from importlib import metadata as _metadata

from . import _ops  # noqa: F401  (registers the custom ops torch.compile traces)
from ._api import flash_decode, plan
from ._merge import merge_state, merge_states

try:
    __version__ = _metadata.version("flash-decode")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = ["flash_decode", "plan", "merge_states", "merge_state", "__version__"]
