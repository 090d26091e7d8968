"""Typed entry-point configs: a dataclass is the schema, YAML files mirror it, command-line flags override it."""
from __future__ import annotations

import dataclasses
import logging
from typing import TypeVar

from jsonargparse import ArgumentParser, ActionConfigFile

T = TypeVar("T")


def parse_config(cls: type[T], argv: list[str] | None, description: str) -> T:
    """Parse ``--config file.yaml`` plus flag overrides into an instance of the dataclass ``cls``."""
    parser = ArgumentParser(description=description, default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file mirroring the dataclass fields")
    parser.add_class_arguments(cls, as_group=False)
    ns = parser.parse_args(argv)
    ns.pop("config", None)
    init = parser.instantiate_classes(ns)
    fields = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in vars(init).items() if k in fields})


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
