"""Models: the offline tiny model factory and model-name resolution."""

from engine.models.resolve import resolve_model
from engine.models.tiny import TinyModelSpec, cached_tiny_model, write_tiny_model

__all__ = ["TinyModelSpec", "cached_tiny_model", "resolve_model", "write_tiny_model"]
