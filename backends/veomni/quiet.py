"""VeOmni's console output, kept where it belongs while the engine calls VeOmni: stdout is ours.

VeOmni 0.1.12 logs through its own stdout handler at INFO (an environment banner at import, the
parallel state, one line per kernel bound), warns that our packed attention "is missing sequence
parallelism support" (the engine refuses SP itself), warns once per all-zero tensor it loads
(freshly initialised biases are all zero), and importing its generated modeling files makes
transformers' auto_docstring print `[ERROR] ... not documented` lines (a docstring lint of VeOmni's
code, not an error of the run). Inside `veomni_output()`:
  - VeOmni's log records below WARNING are dropped, and its handler writes to stderr;
  - the two warnings above are dropped (for zero tensors: biases only; a zero weight is still reported);
  - the auto_docstring lines are dropped from stdout (everything else printed passes through);
  - transformers' own warnings below ERROR (VeOmni passes the deprecated `torch_dtype`) are off;
  - VeOmni's "Loading checkpoint shards" bar is not drawn: the shards are the engine's own staging
    copy of the critic, read once per build (the engine reports the load itself).
Everything is put back when the block ends: no process-wide logging or warning state changes.
VEOMNI_VERBOSITY, when the user sets it, is honoured (levels are left alone).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import sys

_NOISE = ("you are missing sequence parallelism support",)


def _is_noise(record: logging.LogRecord) -> bool:
    message = record.getMessage()
    if any(fragment in message for fragment in _NOISE):
        return True
    # "Detected tensor with all-zero values when reading safetensor: key='model.layers.0.self_attn.q_proj.bias'"
    return "all-zero values" in message and ".bias'" in message


class _DropDocstringLint(io.TextIOBase):
    """A stdout that passes every line on except transformers' auto_docstring lint."""

    def __init__(self, target):
        self.target, self.pending = target, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        for line in lines:
            if not (line.startswith("[ERROR] `") and "but not documented" in line):
                self.target.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.target.write(self.pending)
            self.pending = ""
        self.target.flush()


def _import_veomni() -> None:
    """Import VeOmni with its INFO banner off: it configures its logger's level from VEOMNI_VERBOSITY
    at import. The variable is set only during the import; afterwards the logger gets back the
    level VeOmni would have chosen, and veomni_output() lowers it only inside its blocks."""
    if "veomni" in sys.modules:
        return
    user_set = "VEOMNI_VERBOSITY" in os.environ
    if not user_set:
        os.environ["VEOMNI_VERBOSITY"] = "WARNING"
    try:
        import veomni  # noqa: F401
        from veomni.utils import logging as veomni_logging
    finally:
        if not user_set:
            os.environ.pop("VEOMNI_VERBOSITY", None)
    if not user_set:
        logging.getLogger("veomni").setLevel(veomni_logging._default_log_level)


@contextlib.contextmanager
def _no_shard_bar():
    """VeOmni's weight loader (veomni.models.module_utils) iterates the shards without its tqdm bar."""
    from veomni.models import module_utils

    bar = module_utils.tqdm
    module_utils.tqdm = lambda iterable=None, *args, **kwargs: iterable
    try:
        yield
    finally:
        module_utils.tqdm = bar


@contextlib.contextmanager
def veomni_output():
    """Inside the block VeOmni's output is as the module docstring says; re-entrant."""
    from ...common.valuehead._quiet import quiet_transformers

    _import_veomni()  # first, outside the redirect: VeOmni's handler keeps the stdout it finds
    with contextlib.redirect_stdout(_DropDocstringLint(sys.stdout)) as lint:
        from veomni.utils import logging as veomni_logging

        logger = logging.getLogger("veomni")
        handler = veomni_logging._default_handler
        level, stream = logger.level, getattr(handler, "stream", None)
        noise = logging.Filter()
        noise.filter = lambda record: not _is_noise(record)
        if "VEOMNI_VERBOSITY" not in os.environ:
            logger.setLevel(max(level, logging.WARNING))
        if handler is not None:
            handler.addFilter(noise)
            handler.setStream(sys.stderr)
        try:
            with quiet_transformers(), _no_shard_bar():
                yield
        finally:
            logger.setLevel(level)
            if handler is not None:
                handler.removeFilter(noise)
                if stream is not None:
                    handler.setStream(stream)
            lint.flush()
