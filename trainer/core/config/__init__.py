"""Presets -> typed, validated `Config` (see schema.py for every key and its documentation)."""

from trainer.core.config.load import load_config, to_dict, to_yaml
from trainer.core.config.schema import SCHEMA_VERSION, Config

__all__ = ["Config", "SCHEMA_VERSION", "load_config", "to_dict", "to_yaml"]
