"""Small shared test helpers: inputs with padding, running under pytest from Bazel."""

from __future__ import annotations

import contextlib
import sys

import torch

VOCAB = 1000


def padded_batch(seed: int = 0, batch: int = 3, length: int = 9, vocab: int = VOCAB):
    """Random ids with right padding on some rows: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 10, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        mask[row, length - 2 * row:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def assert_close_on_mask(actual, expected, mask, atol: float, what: str = "values") -> float:
    diff = float((actual - expected).abs()[mask.bool()].max())
    assert diff <= atol, f"{what} differ by {diff:.3g} > {atol}"
    return diff


@contextlib.contextmanager
def vocab_projection_watch(model: torch.nn.Module, vocab: int = VOCAB):
    """Records every call of a module named lm_head or any Linear with `vocab` outputs."""
    calls: list[str] = []
    handles = []
    for name, module in model.named_modules():
        is_vocab_linear = isinstance(module, torch.nn.Linear) and module.out_features == vocab
        if name.split(".")[-1] == "lm_head" or is_vocab_linear:
            handles.append(module.register_forward_hook(lambda m, i, o, name=name: calls.append(name)))
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def run_pytest(file: str) -> None:
    """Entry point for Bazel py_test: run this file's tests with pytest and exit with its status."""
    import pytest

    sys.exit(pytest.main([file, "-q", "-p", "no:cacheprovider", *sys.argv[1:]]))
