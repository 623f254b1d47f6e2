"""Small shared test helpers: inputs with padding, running under pytest from Bazel."""

from __future__ import annotations

import contextlib
import os
import sys

import torch

VOCAB = 1000
# The tensors of a RolloutBatch, in its field order (what the torchrun test workers save and load).
FIELDS = ("input_ids", "attention_mask", "response_mask", "old_values", "returns")


def padded_batch(seed: int = 0, batch: int = 3, length: int = 9, vocab: int = VOCAB):
    """Random ids with right padding on some rows: (input_ids, attention_mask)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab - 10, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    for row in range(1, batch):
        mask[row, length - 2 * row:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    return ids, mask


def save_rollout_batch(path: str, lengths: list[int], seed: int = 0) -> dict:
    """A mini-batch of right-padded rows of the given lengths (response = the last two thirds of each),
    with random returns and small old values, as the torchrun test workers read it; returns it too."""
    g = torch.Generator().manual_seed(seed)
    B, T = len(lengths), max(lengths)
    ids = torch.randint(3, 990, (B, T), generator=g)
    mask = torch.zeros(B, T, dtype=torch.long)
    response = torch.zeros(B, T, dtype=torch.long)
    for i, n in enumerate(lengths):
        mask[i, :n] = 1
        response[i, max(1, n // 3):n] = 1
    data = {"input_ids": ids * mask, "attention_mask": mask, "response_mask": response,
            "old_values": torch.randn(B, T, generator=g) * 0.1 * response,
            "returns": torch.randn(B, T, generator=g) * response}
    torch.save(data, path)
    return data


def final_explained_variance(stdout: str) -> float:
    """The number on a training job's last line, `final explained_variance=<v>`."""
    last = stdout.strip().splitlines()[-1]
    assert last.startswith("final explained_variance="), last
    return float(last.split("=", 1)[1])


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


def sdpa_calls_as_on_cuda(monkeypatch, on_cuda: bool = True) -> list[dict]:
    """Every scaled_dot_product_attention call from here on, recorded (query/key/value head counts,
    enable_gqa, whether a mask was passed, dtype) and run; with `on_cuda`, common.parallel.sdpa
    chooses how to call it as it would for CUDA tensors (issue 41, item 8)."""
    import torch.nn.functional as F

    calls: list[dict] = []
    real = F.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        calls.append({"heads": (query.shape[-3], key.shape[-3], value.shape[-3]),
                      "enable_gqa": kwargs.get("enable_gqa", False), "masked": kwargs.get("attn_mask") is not None,
                      "dtype": query.dtype})
        return real(query, key, value, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    if on_cuda:
        monkeypatch.setattr("critic_adapters.common.parallel.sdpa.kernel_device", lambda t: "cuda")
    return calls


def assert_fused_kernel_calls(calls: list[dict]) -> None:
    """On CUDA only flash takes enable_gqa, and only bf16/fp16 without a mask: every other grouped
    call must arrive with as many K/V heads as query heads."""
    assert calls
    for call in calls:
        flash = call["dtype"] in (torch.bfloat16, torch.float16) and not call["masked"]
        if flash:
            assert call["enable_gqa"] == (len(set(call["heads"])) > 1), call
        else:
            assert not call["enable_gqa"] and len(set(call["heads"])) == 1, call


def run_pytest(file: str, shard_key=None) -> None:
    """Entry point for Bazel py_test: run this file's tests with pytest and exit with its status.
    A target with `shard_count = N` runs every N-th test in each of its N shards (Bazel's test
    sharding protocol), so that its slow cases spread over both of CI's test slots; with
    `shard_key(item)` every N-th group of tests with one key instead (tests that share an expensive
    module fixture stay in one shard)."""
    import pytest

    plugins = []
    sharded = int(os.environ.get("TEST_TOTAL_SHARDS", "1")) > 1
    if sharded:
        plugins.append(_BazelShard(int(os.environ["TEST_SHARD_INDEX"]), int(os.environ["TEST_TOTAL_SHARDS"]),
                                   shard_key))
        if os.environ.get("TEST_SHARD_STATUS_FILE"):  # tells Bazel this runner knows sharding
            open(os.environ["TEST_SHARD_STATUS_FILE"], "a").close()
    accounting = _Accounting.under_bazel()
    if accounting:
        plugins.append(accounting)
    # importlib mode: the test file is imported by path, its imports go through the package name.
    status = pytest.main([file, "-q", "-p", "no:cacheprovider", "--import-mode=importlib", "--durations=10", *sys.argv[1:]],
                         plugins=plugins)
    if accounting:
        accounting.write()
    # A shard can be left with no test of its own (more shards than tests or keys): that is not a failure.
    sys.exit(0 if sharded and status == pytest.ExitCode.NO_TESTS_COLLECTED else status)


class _Accounting:
    """pytest plugin, under Bazel: what this test target cost, for tools/test_times.py (docs/TESTS.md and
    the suite's budget). Writes test_accounting.json into the target's undeclared outputs: each test's
    outcome and seconds, and the CPU seconds of this process and every process it started and waited for
    (torchrun ranks, launchers, servers); the launch log beside it (common.parallel.launch_log) lists the
    processes themselves."""

    @classmethod
    def under_bazel(cls):
        outputs = os.environ.get("TEST_UNDECLARED_OUTPUTS_DIR")
        return cls(outputs) if outputs else None

    def __init__(self, outputs: str):
        from critic_adapters.common.parallel import launch_log

        self.outputs = outputs
        self.tests: dict = {}
        os.environ[launch_log.VARIABLE] = os.path.join(outputs, "launches.jsonl")
        os.environ[launch_log.VARIABLE + "_OWNER"] = str(os.getpid())

    def pytest_runtest_logreport(self, report):
        entry = self.tests.setdefault(report.nodeid.partition("::")[2] or report.nodeid,
                                      {"outcome": "passed", "seconds": 0.0})
        entry["seconds"] = round(entry["seconds"] + report.duration, 3)
        if report.outcome != "passed":
            entry["outcome"] = report.outcome

    def write(self) -> None:
        import json
        import resource

        used = [resource.getrusage(who) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)]
        cpu = sum(usage.ru_utime + usage.ru_stime for usage in used)
        with open(os.path.join(self.outputs, "test_accounting.json"), "w") as out:
            json.dump({"target": os.environ.get("TEST_TARGET"), "shard": os.environ.get("TEST_SHARD_INDEX"),
                       "cpu_seconds": round(cpu, 1), "tests": self.tests}, out, indent=1)


class _BazelShard:
    """pytest plugin: keep the collected tests whose position (or their key's position among the
    keys, in order of first appearance) is `index` modulo `total`."""

    def __init__(self, index: int, total: int, key=None):
        self.index, self.total, self.key = index, total, key

    def pytest_collection_modifyitems(self, config, items):
        if self.key is None:
            positions = list(range(len(items)))
        else:
            order: dict = {}
            positions = [order.setdefault(self.key(item), len(order)) for item in items]
        keep = [item for item, p in zip(items, positions) if p % self.total == self.index]
        config.hook.pytest_deselected(items=[item for item, p in zip(items, positions) if p % self.total != self.index])
        items[:] = keep


@contextlib.contextmanager
def read_only_dir(path: str):
    """Make the existing directory `path` read-only inside the block.

    A normal user gets chmod 0555. Root ignores permission bits, so for root an empty read-only
    tmpfs is mounted over `path` instead (the test is skipped where mounting is not allowed).
    """
    import subprocess

    import pytest

    if os.geteuid() != 0:
        os.chmod(path, 0o555)
        try:
            yield path
        finally:
            os.chmod(path, 0o755)
        return
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=64k", "tmpfs", str(path)], capture_output=True)
    if mounted.returncode != 0:
        pytest.skip(f"running as root and cannot mount a read-only tmpfs: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def tree_snapshot(path) -> dict:
    """{relative path: (size, mtime_ns)} of every file and directory under `path`: equal snapshots mean
    nothing was written there."""
    out = {}
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            full = os.path.join(root, name)
            stat = os.stat(full)
            out[os.path.relpath(full, path)] = (stat.st_size if name in files else 0, stat.st_mtime_ns)
    return out


# A shorter job than the default, for the resume tests: 512 rollouts, 2 epochs of 15 steps; a
# checkpoint every 8 (the resume tests kill a run after step 16's), each one a collective save.
SHORT_JOB = ("data.num_rollouts=512", "data.mini_batch_size=32", "trainer.epochs=2", "trainer.save_every_steps=8",
             "trainer.keep_last=3", "trainer.tensorboard=false", "trainer.plot=false", "trainer.progress=false")


def assert_same_exported_weights(run_dir, other_run_dir) -> None:
    """The two runs' hf_export/model.safetensors hold the same tensors, bit for bit."""
    from safetensors.torch import load_file

    a, b = (load_file(os.path.join(d, "hf_export", "model.safetensors")) for d in (run_dir, other_run_dir))
    assert a.keys() == b.keys()
    different = [k for k in a if not (a[k] == b[k]).all()]
    assert not different, f"resumed weights differ from the uninterrupted run in {different}"


def _missing_library(name: str) -> str | None:
    """Why backend `name` cannot run here (its library is not installed), or None."""
    from critic_adapters.common.engine.registry import check_installed

    try:
        check_installed(name)
    except ImportError as missing:
        return str(missing)
    return None


def installed_backends(names) -> tuple[str, ...]:
    """Those of `names` whose library this environment has."""
    return tuple(name for name in names if _missing_library(name) is None)


def skip_without_backend(name: str) -> None:
    """Skip the test where backend `name`'s library is not installed (an environment without the
    extra), naming what is missing."""
    import pytest

    missing = _missing_library(name)
    if missing:
        pytest.skip(missing)
