"""Typed entry-point configs: a dataclass is the schema, YAML files mirror it, command-line flags override it.

Every entry point reads its config with :func:`parse_config` and runs under :func:`user_errors`, so what a user gets
wrong (an unknown option, a wrong type, a value out of range, a missing file, an unknown model source) ends in one line
``<prog>: error: <message>`` and exit code 2, like jsonargparse's own errors, not in a traceback
(``SPECSTOP_TRACEBACK=1`` shows the traceback). MLflow URIs of every entry point: :func:`resolve_tracking_uri`.
Every entry point's ``main`` calls :func:`setup_logging` first, which also filters, once, the library warnings and log
lines a user cannot act on (:func:`quiet_libraries`; ``SPECSTOP_ALL_WARNINGS=1`` shows them all).

Usage::

    def main(argv=None):
        with user_errors("python -m pipelines.generate"):
            cfg = parse_config(GenerateConfig, argv, __doc__)
            return generate(cfg)
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
import shlex
import sys
import types
import typing
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TypeVar

import yaml
from jsonargparse import ActionConfigFile, ArgumentParser

from compute.code_version import record_start

T = TypeVar("T")

USER_ERRORS = (ValueError, KeyError, FileNotFoundError, NotADirectoryError, FileExistsError, ConnectionError,
               TimeoutError)
"""Exceptions that carry a message for the user (config checks, unknown model sources, missing files or columns, a
data folder made by another config, a tracking server that does not answer, a lock held by another run)."""


def parse_config(cls: type[T], argv: list[str] | None, description: str) -> T:
    """Parse ``--config file.yaml`` plus flag overrides into an instance of the dataclass ``cls``.

    A check of the dataclass (``__post_init__``) that refuses a value exits like a parse error: ``error: <message>``
    on stderr, exit code 2. A list-of-strings field also takes one bare value (``--predictors REF``).
    """
    parser = ArgumentParser(description=description, default_config_files=[])
    parser.add_argument("--config", action=ActionConfigFile, help="YAML file mirroring the dataclass fields")
    parser.add_class_arguments(cls, as_group=False)
    ns = parser.parse_args(one_item_lists(cls, sys.argv[1:] if argv is None else argv))
    ns.pop("config", None)
    try:
        init = parser.instantiate_classes(ns)
        fields = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: v for k, v in vars(init).items() if k in fields})
        uri = getattr(cfg, "tracking_uri", None) or os.environ.get("MLFLOW_TRACKING_URI")
        if uri and hasattr(cfg, "tracking_uri"):
            check_tracking_uri(uri)
        return cfg
    except (ValueError, TypeError) as e:
        parser.error(_one_line(e))
        raise  # parser.error exits; unreachable


def one_item_lists(cls: type, argv: list[str]) -> list[str]:
    """``argv`` with a bare value after a flag of a list-of-strings field of ``cls`` (``--predictors REF``,
    ``--predictors=REF``) written as the one-item list ``["REF"]``: jsonargparse takes a list only in brackets (or one
    item at a time through ``--predictors+ REF``). Values in brackets, ``null`` and other flags pass unchanged."""
    try:
        hints = typing.get_type_hints(cls)
    except (NameError, TypeError):
        return list(argv)
    flags = {f"--{name}" for name, tp in hints.items() if _is_str_list(tp)}

    def bare(value: str) -> bool:
        return not value.lstrip().startswith(("[", "--")) and value not in ("null", "None")

    out, i = [], 0
    while i < len(argv):
        flag, eq, value = argv[i].partition("=")
        if flag in flags and eq and bare(value):
            out.append(f"{flag}={json.dumps([value])}")
        elif flag in flags and not eq and i + 1 < len(argv) and bare(argv[i + 1]):
            out += [flag, json.dumps([argv[i + 1]])]
            i += 1
        else:
            out.append(argv[i])
        i += 1
    return out


def _is_str_list(tp: object) -> bool:
    """``list[str]``, alone or in a union (``list[str] | None``)."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        return any(_is_str_list(t) for t in typing.get_args(tp))
    return typing.get_origin(tp) is list and typing.get_args(tp) == (str,)


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


TRACKING_SCHEMES = ("sqlite", "http", "https", "postgresql", "mysql", "mssql", "databricks")
"""URI schemes MLflow's tracking store accepts (a database, a server); ``postgresql+psycopg2`` and such count too."""


def check_tracking_uri(uri: str) -> None:
    """Refuse, before any work, a tracking URI MLflow would refuse after it: a bare path or ``file:`` URI (MLflow's
    retired file store), an unknown scheme, or a SQLite file whose folder cannot be made. The message says what to pass.
    """
    scheme = uri.split(":", 1)[0].split("+", 1)[0].lower() if ":" in uri else ""
    if len(scheme) == 1:  # a Windows drive letter is a path, not a scheme
        scheme = ""
    if scheme in ("", "file"):
        path = uri.removeprefix("file://").removeprefix("file:")
        raise ValueError(f"tracking URI {uri!r} is a path, which MLflow reads as its retired file store; pass "
                         f"sqlite:///{path.rstrip('/')}.db (a local database) or http://HOST:5000 (a tracking server)")
    if scheme not in TRACKING_SCHEMES:
        raise ValueError(f"tracking URI {uri!r}: scheme {scheme!r} is not a tracking store; pass sqlite:///FILE.db, "
                         f"http(s)://HOST:PORT or a database URI ({', '.join(TRACKING_SCHEMES)})")
    if scheme == "sqlite" and uri.startswith("sqlite:///") and uri != "sqlite:///:memory:":
        folder = Path(uri.removeprefix("sqlite:///")).expanduser().parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"tracking URI {uri!r}: cannot create its folder {folder} ({e.strerror}); pass "
                             f"sqlite:///<a writable path>.db") from e
        if not os.access(folder, os.W_OK):
            raise ValueError(f"tracking URI {uri!r}: folder {folder} is not writable; pass sqlite:///<a writable "
                             f"path>.db")


def setup_logging() -> None:
    """Log INFO to stderr with a time stamp, and filter the library chatter (:func:`quiet_libraries`)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    quiet_libraries()


NOISE_WARNINGS = (
    # Lightning: the DataModule serves in-memory tensors; workers only add start-up
    r"The '\w+' does not have many workers",
    r"You defined a `validation_step` but have no `val_dataloader`",  # the SV table fits without a val loop
    r"`LightningModule.configure_optimizers` returned `None`",  # the SV table is counted, not optimised
    r"The number of training batches \(\d+\) is smaller than the logging interval",
    r"Checkpoint directory .* exists and is not empty",  # the main job owns its checkpoint folders
    r"An input example was not provided when logging the model",  # MLflow: the registry infers the signature itself
)
"""Messages (regular expressions, searched) of warnings dropped at the entry point: each is about how specstop calls a
library, not about anything the user passed. Deprecation and future warnings raised inside installed libraries are
dropped too."""

NOISE_LOGS = {
    "transformers.generation.utils": r"Passing `generation_config` together with generation-related arguments",
    # transformers >= 5.24 renames the forward's cache argument; specstop passes past_key_values, which every version
    # from the lowest it supports (4.56) reads
    "transformers.utils.generic": r"`past_key_values`/`cache_params` are deprecated",
    "mlflow.pyfunc": r"Passing a Python object as `python_model`",
    "pytorch_lightning.loggers.mlflow": r"Experiment with name .* not found\. Creating it",
    "lightning.pytorch.loggers.mlflow": r"Experiment with name .* not found\. Creating it",
}
"""Logger -> message (regular expression) of log records dropped at the entry point."""

QUIET_LOGGERS = (
    "pytorch_lightning.utilities.rank_zero",  # GPU / TPU available, tips, `Trainer.fit` stopped (once per fit)
    "lightning.pytorch.utilities.rank_zero",
    "pytorch_lightning.trainer.connectors.checkpoint_connector",  # `weights_only` was not set
    "lightning.pytorch.trainer.connectors.checkpoint_connector",
    "pytorch_lightning.accelerators.cuda",
    "lightning.pytorch.accelerators.cuda",
    "mlflow.store.db.utils",  # creating / updating the SQLite tables
    "alembic",
)
"""Loggers whose INFO lines are dropped (their warnings and errors stay)."""

_LIBRARY_DIRS = ("site-packages", "dist-packages")
_quieted = False


class _DropMessages(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(str(record.msg))


def is_noise_warning(message: str, category: type[Warning], filename: str = "") -> bool:
    """True for a warning :func:`quiet_libraries` drops: a known library message, or a deprecation / future warning
    raised inside an installed library."""
    if issubclass(category, (DeprecationWarning, FutureWarning)) and any(d in filename for d in _LIBRARY_DIRS):
        return True
    return any(re.search(p, message) for p in NOISE_WARNINGS)


def quiet_libraries() -> None:
    """Drop, once per process, the library warnings and log lines a user cannot act on (:data:`NOISE_WARNINGS`,
    :data:`NOISE_LOGS`, :data:`QUIET_LOGGERS`, the progress bars of ``datasets`` and of MLflow's artifact downloads);
    every other warning (a truncated prompt, a skipped predictor, a precision mismatch) stays.

    Works through ``warnings.showwarning`` rather than the filter list, so that a library that installs its own filters
    when it is imported later (Lightning does) cannot bring the noise back. ``SPECSTOP_ALL_WARNINGS=1`` turns it off.
    """
    global _quieted
    if _quieted or os.environ.get("SPECSTOP_ALL_WARNINGS"):
        return
    _quieted = True
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):  # type: ignore[no-untyped-def]
        if not is_noise_warning(str(message), category, str(filename)):
            shown(message, category, filename, lineno, file, line)

    warnings.showwarning = showwarning
    for name, pattern in NOISE_LOGS.items():
        logging.getLogger(name).addFilter(_DropMessages(pattern))
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules:  # read from the environment at import: switch it off in the imported module too
        sys.modules["datasets"].disable_progress_bars()


def command_line(prog: str, argv: list[str] | None = None) -> str:
    """The command that started this process: ``prog`` (``python -m pipelines.x``) and ``argv``, the command line's
    arguments when None."""
    return shlex.join([*shlex.split(prog), *(sys.argv[1:] if argv is None else argv)])


def start_run(cfg: object, prog: str, argv: list[str] | None = None) -> Path:
    """Create the run's ``cfg.out_dir``, write its resolved config there as ``config.yaml`` headed by the command that
    runs it again (``prog --config <that file>``), and record the code and the command (``prog`` and ``argv``, the
    command line's when None) of this start (``compute.code_version.record_start``: the stored summary names the code
    the rows ran on and the command that ran them, neither typed at storing time). Returns the folder."""
    out_dir = Path(cfg.out_dir)  # type: ignore[attr-defined]
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "config.yaml"
    path.write_text(f"# {prog} --config {path}\n" + yaml.safe_dump(dataclasses.asdict(cfg)))  # type: ignore[arg-type]
    record_start(out_dir, command=command_line(prog, argv))
    return out_dir
