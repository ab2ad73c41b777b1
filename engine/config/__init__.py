"""primeflow's configuration: pydantic models for every section, and the loader for TOML + flags."""

from engine.config.loader import ConfigError, load_config, with_overrides
from engine.config.model import TINY_MODEL
from engine.config.root import SHARED_FIELDS, PrimeflowConfig

__all__ = [
    "SHARED_FIELDS",
    "TINY_MODEL",
    "ConfigError",
    "PrimeflowConfig",
    "load_config",
    "with_overrides",
]
