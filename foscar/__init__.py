"""foscar: affine-folded decode attention over 2-bit and 4-bit KV caches (FOSCAR, arXiv 2611.09722)."""
from ._version import __version__
from .api import DecodePlan, append, backend_status, decode, plan, select_backend
from .cache import PageTable, QuantKVCache
from .cache_io import from_flashinfer_nvfp4, quantize_kv
from .errors import FoscarError, InvalidArgumentError, UnsupportedError
from .fold import combine_partials, decode_folded
from .format import (
                     BF16_INJECTION,
                     CHANNEL,
                     E2M1_PLACEMENT,
                     E4M3_PLACEMENT,
                     LAYOUT_TAG,
                     MAPPINGS,
                     TOKEN,
                     KVFormat,
                     OperandMapping,
                     pack_codes,
                     unpack_codes,
)
from .reference import decode_exact


__all__ = [
                     "BF16_INJECTION",
                     "CHANNEL",
                     "DecodePlan",
                     "E2M1_PLACEMENT",
                     "E4M3_PLACEMENT",
                     "LAYOUT_TAG",
                     "MAPPINGS",
                     "TOKEN",
                     "FoscarError",
                     "InvalidArgumentError",
                     "KVFormat",
                     "OperandMapping",
                     "PageTable",
                     "QuantKVCache",
                     "UnsupportedError",
                     "__version__",
                     "append",
                     "backend_status",
                     "combine_partials",
                     "decode",
                     "decode_exact",
                     "decode_folded",
                     "from_flashinfer_nvfp4",
                     "pack_codes",
                     "plan",
                     "quantize_kv",
                     "select_backend",
                     "unpack_codes",
]
