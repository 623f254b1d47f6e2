"""Silence transformers' own load report and progress bars while we print a report of our own."""

from __future__ import annotations

import contextlib

from transformers.utils import logging as hf_logging


@contextlib.contextmanager
def quiet_transformers():
    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
