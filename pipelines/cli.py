"""Typed entry-point configs: a dataclass is the schema, YAML files mirror it, command-line flags override it.

Every entry point reads its config with :func:`parse_config` and runs under :func:`user_errors`, so what a user gets
wrong (an unknown option, a wrong type, a value out of range, a missing file, an unknown model source) ends in one line
``<prog>: error: <message>`` and exit code 2, like jsonargparse's own errors, not in a traceback
(``SPECSTOP_TRACEBACK=1`` shows the traceback). MLflow URIs of every entry point: :func:`resolve_tracking_uri`.

Usage::

    def main(argv=None):
        with user_errors("python -m pipelines.generate"):
            cfg = parse_config(GenerateConfig, argv, __doc__)
            return generate(cfg)
"""
from __future__ import annotations

import dataclasses
import logging
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TypeVar

from jsonargparse import ActionConfigFile, ArgumentParser

T = TypeVar("T")

USER_ERRORS = (ValueError, KeyError, FileNotFoundError, NotADirectoryError)
"""Exceptions that carry a message for the user (config checks, unknown model sources, missing files or columns)."""


def parse_config(cls: type[T], argv: list[str] | None, description: str) -> T:
    """Parse ``--config file.yaml`` plus flag overrides into an instance of the dataclass ``cls``.

    A check of the dataclass (``__post_init__``) that refuses a value exits like a parse error: ``error: <message>``
    on stderr, exit code 2.
    """
    parser = ArgumentParser(description=description, default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file mirroring the dataclass fields")
    parser.add_class_arguments(cls, as_group=False)
    ns = parser.parse_args(argv)
    ns.pop("config", None)
    try:
        init = parser.instantiate_classes(ns)
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(init).items() if k in fields})
    except (ValueError, TypeError) as e:
        parser.error(_one_line(e))
        raise  # parser.error exits; unreachable


@contextmanager
def user_errors(prog: str | None = None) -> Iterator[None]:
    """Turn a :data:`USER_ERRORS` exception raised inside into ``<prog>: error: <message>`` on stderr and exit code 2.

    Args:
        prog: the command as the user typed it (default: ``sys.argv[0]``'s name).
    """
    try:
        yield
    except USER_ERRORS as e:
        if os.environ.get("SPECSTOP_TRACEBACK"):
            raise
        name = prog or os.path.basename(sys.argv[0]) or "specstop"
        print(f"{name}: error: {_one_line(e)}", file=sys.stderr)
        raise SystemExit(2) from e


def _one_line(e: BaseException) -> str:
    msg = str(e.args[0]) if isinstance(e, KeyError) and e.args else str(e)  # KeyError's str() adds quotes
    return " ".join(msg.split()) or type(e).__name__


def resolve_tracking_uri(value: str | None = None) -> str:
    """The MLflow tracking URI of every entry point: ``value``, else ``$MLFLOW_TRACKING_URI``, else the URI set in
    this process, else ``sqlite:///mlflow.db`` (the one implementation is ``predictors.registry.resolve_tracking_uri``,
    which the registry uses for ``models:/`` references)."""
    from predictors.registry import resolve_tracking_uri as resolve

    return resolve(value)


def setup_logging() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
