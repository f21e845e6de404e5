"""specdec: grammar-constrained decoding on MLX at speculative-decoding throughput."""

from .models import LoadedModel, load

__all__ = ["LoadedModel", "load"]
__version__ = "0.1.0"
