"""flash_decode: flash decoding (split-KV attention plus an LSE combine) for NVIDIA GPUs, a Go
core driven from PyTorch. Importing it loads no native code: the first call does, once a usable
CUDA driver has been confirmed. Reference: docs/api.md."""

from importlib import metadata as _metadata

from . import _ops  # noqa: F401  (registers the custom ops torch.compile traces)
from ._api import flash_decode, plan
from ._decoder import Decoder
from ._graphs import DecoderGraphs
from ._merge import merge_state, merge_states
from . import distributed  # noqa: F401  (flash_decode.distributed: decode over a sharded cache)

try:
    __version__ = _metadata.version("flash-decode")
except _metadata.PackageNotFoundError:  # running from a source tree
    __version__ = "0+unknown"

__all__ = ["flash_decode", "plan", "Decoder", "DecoderGraphs", "merge_states", "merge_state", "__version__"]
