"""Typed configuration: frozen dataclasses, YAML recipes and `--set` overrides (see `loader`)."""

from hpcrlhf.config.loader import (
    apply_overrides,
    describe,
    field_docs,
    from_dict,
    load_config,
    to_dict,
    to_yaml,
)

__all__ = ["apply_overrides", "describe", "field_docs", "from_dict", "load_config", "to_dict", "to_yaml"]
