"""The launcher on one process under faults: resume with changed settings, two runs on one run_dir,
stale metrics, a YAML syntax error, Ctrl-C, an unknown backend, flags after overrides, bad rollouts,
a model that makes NaN, a full disk."""

import json
import os
import shutil
import signal
import subprocess
import sys

import pytest
from safetensors.torch import load_file, save_file

from critic_adapters.backends.fsdp.tests.launch import launch_in_process, launcher_env, run_launcher
from critic_adapters.common.learning.data import make_default_records
from critic_adapters.common.job.metrics import read_metrics
from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest, tree_snapshot

FAST = ["data.num_rollouts=64", "data.mini_batch_size=16", "trainer.epochs=1", "trainer.tensorboard=false",
        "trainer.plot=false", "trainer.progress=false", "trainer.export_hf=false"]


def ok(result):
    assert result.returncode == 0, f"rc={result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    return result


def refused(result, *fragments):
    assert result.returncode == 2, f"rc={result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-3000:]}"
    for fragment in fragments:
        assert fragment in result.stderr, f"{fragment!r} not in:\n{result.stderr[-3000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def test_resume_refuses_changed_settings_and_applies_changeable_ones(tmp_path):
    ok(run_launcher(f"trainer.run_dir={tmp_path}", *FAST))
    before = tree_snapshot(tmp_path)
    result = run_launcher(f"trainer.run_dir={tmp_path}", *FAST, "engine.optim.lr=0.5", "data.num_rollouts=32",
                          "--resume")
    refused(result, "--resume: settings that cannot change mid-run differ from", "config.yaml",
            "engine.optim.lr: 0.002 in the run, 0.5 now", "data.num_rollouts: 64 in the run, 32 now")
    assert tree_snapshot(tmp_path) == before, "a refused resume changed the run_dir"

    result = ok(run_launcher(f"trainer.run_dir={tmp_path}", *FAST, "trainer.epochs=2", "--resume"))
    assert "resume: trainer.epochs changed from 1 to 2 (the LR schedule still spans the run's 4 steps)" in result.stdout
    saved = open(tmp_path / "config.yaml").read()
    assert "epochs: 2" in saved and "total_steps: 4" in saved
    steps = [r["step"] for r in read_metrics(str(tmp_path / "metrics.jsonl")) if r["split"] == "train"]
    assert steps == list(range(1, 9)), steps


def test_a_second_run_on_a_run_dir_in_use_is_refused_naming_the_holder(tmp_path):
    env = dict(launcher_env(), PYTHONUNBUFFERED="1")
    first = subprocess.Popen([sys.executable, "-m", "critic_adapters.backends.fsdp.train", f"trainer.run_dir={tmp_path}",
                              "data.num_rollouts=512", "trainer.progress=false", "trainer.epochs=20"], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # Once the first run has a checkpoint: the second is told the run_dir is in use, not that it
        # holds checkpoints (that check used to come first, and a slow start saw it).
        for line in first.stdout:
            if line.startswith("checkpoint saved: "):
                break
        second = run_launcher(f"trainer.run_dir={tmp_path}", *FAST)
        refused(second, f"{tmp_path} is in use by another run (pid {first.pid}", "choose another trainer.run_dir")
    finally:
        first.kill()
        first.wait()


def test_a_fresh_run_starts_its_metrics_afresh(tmp_path):
    stale = {"step": 999, "split": "train", "value_loss": 1.0}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(stale) + "\n")  # left by a run killed before a checkpoint
    ok(run_launcher(f"trainer.run_dir={tmp_path}", *FAST))
    records = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in records if r["split"] == "train"] == [1, 2, 3, 4]


def test_yaml_syntax_error_is_one_line(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("engine:\n  optim:\n    lr: [1e-4\n  seed: 3\n")
    result = launch_in_process(str(config), f"trainer.run_dir={tmp_path / 'run'}")
    refused(result, f"error: {config}:4:")
    assert len(result.stderr.strip().splitlines()) == 1 and "YAML syntax error" in result.stderr


def test_ctrl_c_is_one_line_and_exit_130(tmp_path):
    env = dict(launcher_env(), PYTHONUNBUFFERED="1")
    process = subprocess.Popen([sys.executable, "-m", "critic_adapters.backends.fsdp.train", f"trainer.run_dir={tmp_path}",
                                "data.num_rollouts=512", "data.mini_batch_size=32", "trainer.save_every_steps=4",
                                "trainer.progress=false", "trainer.tensorboard=false"], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in process.stdout:
        if line.startswith("checkpoint saved: ") and line.rstrip().endswith("/step_000004"):
            break
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr[-3000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("interrupted at step "), stderr[-3000:]
    assert "; resume with --resume (from step_0000" in lines[0]


def test_dry_run_with_an_unregistered_backend(tmp_path):
    refused(launch_in_process("--dry-run", "backend=deepspeed", f"trainer.run_dir={tmp_path}"),
            "backend='deepspeed' is not registered; available: fsdp, megatron, veomni")


def test_flags_after_overrides(tmp_path):
    result = ok(launch_in_process(f"trainer.run_dir={tmp_path}", "--print-config", "engine.optim.lr=0.25"))
    assert "lr: 0.25" in result.stdout


@pytest.mark.parametrize("edit,fragments", [
    (lambda r: r["input_ids"].__setitem__(2, 100.7), ["row 3: input_ids: expected integer token ids, got float 100.7"]),
    (lambda r: r.update(old_values=[0.0] * len(r["input_ids"])), ["row 0: missing field 'old_values' (row 3 has it)"]),
])
def test_bad_rollouts_change_nothing_in_the_run_dir(tmp_path, edit, fragments):
    records = make_default_records(16)
    edit(records[3])
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("mine")
    before = tree_snapshot(run_dir)
    refused(launch_in_process(f"data.train_path={path}", f"trainer.run_dir={run_dir}", *FAST),
            f"invalid rollouts in {path}", *fragments)
    assert tree_snapshot(run_dir) == before


def test_nan_made_by_the_model_is_blamed_on_the_model(tmp_path):
    model = save_tiny_causal_lm("qwen2", str(tmp_path / "model"))
    weights = os.path.join(model, "model.safetensors")
    state = load_file(weights)
    state["model.layers.0.mlp.down_proj.weight"][0, 0] = float("nan")  # a matrix load_critic does not scan
    save_file(state, weights, metadata={"format": "pt"})
    result = launch_in_process(f"engine.model.path={model}", f"trainer.run_dir={tmp_path / 'run'}", *FAST)
    refused(result, "the initial critic's values are NaN/inf", f"the model ({model}) produces them, not the rollout data")
    assert "fix the rollout data" not in result.stderr


def test_full_disk_names_the_disk_the_sizes_and_the_last_good_checkpoint(tmp_path, monkeypatch):
    from critic_adapters.common.engine.config import load_train_config
    from critic_adapters.common.parallel.distributed import init_distributed
    from critic_adapters.common.job.trainer import run_training

    real = shutil.disk_usage
    calls = []

    def disk_usage(path):
        usage = real(path)
        calls.append(path)
        free = usage.free if len(calls) == 1 else 1000  # room for the first checkpoint only
        return type(usage)(usage.total, usage.total - free, free)

    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    config = load_train_config([], [f"trainer.run_dir={tmp_path}", *FAST, "trainer.save_every_steps=2"])
    with pytest.raises(ValueError) as err:
        run_training(config, init_distributed(), say=lambda *a: None)
    message = str(err.value)
    ckpt = tmp_path / "checkpoints"
    assert message.startswith("not enough disk space to save step_000004: it needs about "), message
    assert "MiB, the disk at /" in message and " has 0.0 MiB free" in message, message
    assert f"the last good checkpoint is {ckpt / 'step_000002'}" in message and "--resume" in message
    assert sorted(os.listdir(ckpt)) == ["latest", "step_000002"]


if __name__ == "__main__":
    run_pytest(__file__)
