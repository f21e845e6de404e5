"""specdec: grammar-constrained decoding on MLX at speculative-decoding throughput."""

import os as _os

# transformers warns at import that PyTorch is absent; we only use its tokenizers.
_os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from .models import LoadedModel, load

__all__ = ["LoadedModel", "load"]
__version__ = "0.1.0"
