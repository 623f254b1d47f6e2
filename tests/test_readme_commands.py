"""Every command in the README and its guides runs as written (issue 14): the fenced `bash` lines and the
Python examples are read from README.md and the guides under docs/ (GUIDES, in the order the README lists
them), run in order in a scratch directory with the placeholders bound to tiny fixtures, and each must
exit 0. An edit that breaks a command fails here.

Tiny settings: `my.yaml` (the README's "your settings") holds the README's example line and a small job; launcher lines that name
no YAML file and do not resume get the same small settings as overrides. Nothing else is changed.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys


from critic_adapters.common.learning.data import make_default_records
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_launcher, run_launcher_in_process, worker_env

VALUEHEAD = "critic_adapters.common.valuehead"
ROOT = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
README = os.path.join(ROOT, "README.md")
# The guides the README's front page links, in its order: their commands run after the README's own.
GUIDES = [os.path.join(ROOT, "docs", name) for name in (
    "USING.md", "VALUE_LEARNING.md", "AGENTIC.md", "VISION.md", "RAY.md", "VERL.md", "OFFLOAD.md", "LARGE_CRITICS.md",
    "GPUS.md")]

TINY = ["data.num_rollouts=48", "data.mini_batch_size=16", "trainer.epochs=1", "trainer.save_every_steps=0"]
# The tiny job, after the README's own example line (written dotted, as the README shows it).
MY_YAML_TINY = """\
data.num_rollouts: 48
data:
  mini_batch_size: 16
trainer:
  epochs: 1
  save_every_steps: 0
"""
PLACEHOLDERS = {"CKPT": "tiny-model", "SRC": "tiny-model", "DST": "tiny-critic",
                "engine.model.path=CKPT": "engine.model.path=tiny-model"}
# Lines not run here, each with the reason; every one must still be in the README.
NOT_RUN = {
    "./run.sh main": "the fsdp launcher line it execs is what backends/fsdp/tests/test_training_job.py runs",
    "./run.sh test": "it is what runs this test",
}


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, flags=re.S | re.M)


def readme_blocks(language: str) -> list[str]:
    """The README's `language` blocks, then each guide's."""
    return [block for path in (README, *GUIDES) for block in blocks(read(path), language)]


def test_the_readme_links_every_guide():
    text = read(README)
    for path in GUIDES:
        assert f"(docs/{os.path.basename(path)})" in text, f"the README does not link {path}"


def readme_settings_example() -> str:
    """The settings line the README gives as `my.yaml`'s example (`engine.optim.lr: 1.0e-3`)."""
    with open(README) as f:
        found = re.search(r"`my\.yaml`: your settings,\s+e\.g\.\s+`([^`]+)`", f.read())
    assert found, "the README no longer gives an example line for my.yaml"
    return found.group(1)


def readme_commands() -> list[str]:
    lines = []
    for block in readme_blocks("bash"):
        for line in block.splitlines():
            command = line.split("  #")[0].strip()  # a comment after two spaces
            if command:
                lines.append(command)
    return lines


def bound(command: str) -> list[str]:
    words = [PLACEHOLDERS.get(word, word) for word in shlex.split(command)]
    launcher = any(word.startswith("critic_adapters.backends.") or word == "critic_adapters.train" for word in words)
    if launcher and "my.yaml" not in words and "--resume" not in words:
        words += TINY
    return words


def write_rollouts(path: str) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = make_default_records(48, seed=3)
    pq.write_table(pa.Table.from_pylist(records), path)


def test_the_not_run_lines_are_in_the_readme():
    commands = readme_commands()
    for line in NOT_RUN:
        assert line in commands, f"{line!r} is no longer in the README: drop it from NOT_RUN"


def test_every_readme_command_runs_as_written(tmp_path):
    os.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text(f"{readme_settings_example()}\n{MY_YAML_TINY}")
    write_rollouts(str(tmp_path / "rollouts.parquet"))
    commands = [c for c in readme_commands() if c not in NOT_RUN]
    assert len(commands) >= 10, commands
    for command in commands:
        words = bound(command)
        assert words[0] == "python", f"a README command this test cannot run: {command!r}"
        if words[1:3] == ["-m", VALUEHEAD] or "--dry-run" in words:  # they start and train nothing: in this process
            module = f"{VALUEHEAD}.cli" if words[2] == VALUEHEAD else words[2]
            result = run_launcher_in_process(module, *words[3:])
        else:  # a launch: --nproc N > 1 ones run their launcher part in this process, as every job test's do
            assert words[1] == "-m", f"a README command this test cannot run: {command!r}"
            result = run_launcher(words[2], *words[3:], timeout=900)
        assert result.returncode == 0, (f"README command failed (rc={result.returncode}): {command}\n"
                                        f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
        if "--resume" in words and "--dry-run" not in words:  # the two-process run goes on on two processes
            assert "starting 2 processes, as the run last ran" in result.stdout, result.stdout[-3000:]
    # The commands did what the README says they do.
    assert (tmp_path / "tiny-critic" / "config.json").is_file()
    assert (tmp_path / "values.parquet").is_file()
    for run in ("outputs/my-run", "outputs/megatron-default", "outputs/tp2-pp2", "outputs/veomni-default",
                "outputs/warm-critic"):
        assert (tmp_path / run / "hf_export" / "config.json").is_file(), run
    import json

    with open(tmp_path / "outputs/my-run/metrics.jsonl") as f:
        epochs = {json.loads(line)["epoch"] for line in f}
    assert max(epochs) == 8  # --resume ... trainer.epochs=8 continued the 1-epoch run


def test_the_python_example_runs(tmp_path):
    example = readme_blocks("python")[0]
    model_dir = str(tmp_path / "model")
    from critic_adapters.common.testdata import save_tiny_causal_lm

    save_tiny_causal_lm("qwen2", model_dir)
    code = example.replace("path/to/any/critic/or/causal-lm", model_dir).replace("out/critic", str(tmp_path / "out"))
    prelude = ("import torch\ninput_ids = torch.tensor([[5, 6, 7, 8]])\nattention_mask = torch.ones_like(input_ids)\n")
    result = subprocess.run([sys.executable, "-c", prelude + code + "\nassert values.shape == (1, 4)\n"],
                            env=worker_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "out" / "config.json").is_file()


def test_the_readmes_yaml_settings_are_keys_the_job_takes(tmp_path):
    """Every YAML block of the README written for the job (top-level engine / data / trainer keys)
    loads as a layer of the job's config: no key or value the job would refuse."""
    import yaml

    from critic_adapters.common.engine.config import load_train_config

    blocks = [block for block in readme_blocks("yaml")
              if set(yaml.safe_load(block) or {}) <= {"engine", "data", "trainer", "backend"}]
    assert len(blocks) >= 2, blocks
    for index, block in enumerate(blocks):
        path = tmp_path / f"block{index}.yaml"
        path.write_text(block)
        load_train_config([str(path)], [])


def test_the_multi_turn_example_runs(tmp_path):
    """docs/AGENTIC.md's multi-turn snippet (GAE with turns, truncation and moved rewards; an update with a
    value mask) on the embedded multi-turn rollouts, with an fsdp engine of a tiny critic."""
    (example,) = blocks(read(os.path.join(ROOT, "docs", "AGENTIC.md")), "python")
    prelude = f"""
import torch
from critic_adapters.common.engine.config import EngineConfig, ModelConfig
from critic_adapters.common.engine.registry import build_engine
from critic_adapters.common.learning.data import to_rollouts
from critic_adapters.common.learning.multi_turn import make_multi_turn_records
from critic_adapters.common.parallel.distributed import init_distributed
from critic_adapters.common.testdata import save_tiny_causal_lm

model = save_tiny_causal_lm("qwen2", {str(tmp_path / "model")!r})
engine = build_engine("fsdp", EngineConfig(model=ModelConfig(path=model)), init_distributed())
r = to_rollouts(make_multi_turn_records(16, seed=1))
input_ids, attention_mask, response_mask, rewards = r.input_ids, r.attention_mask, r.response_mask, r.rewards
turn_ids, truncated, value_mask = r.turn_ids, r.truncated, r.response_mask
old_values = torch.zeros_like(rewards)
assert truncated.any()
"""
    check = "\nassert returns.shape == rewards.shape and bool((returns[response_mask.bool()] != 0).any())\n"
    result = subprocess.run([sys.executable, "-c", prelude + example + check], env=worker_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_vision_example_runs(tmp_path):
    """docs/VISION.md's vision-critic snippet, with a stand-in for a Qwen-VL processor (its batch layout:
    every row's patches concatenated in pixel_values, image_grid_thw per image) and a tiny VLM."""
    (example,) = blocks(read(os.path.join(ROOT, "docs", "VISION.md")), "python")
    from critic_adapters.common.testdata import save_tiny_causal_lm

    model = save_tiny_causal_lm("qwen2_vl", str(tmp_path / "vlm"))
    prelude = """
import torch
from critic_adapters.common.learning.media import split_processor_batch
from critic_adapters.common.testdata import tiny_config
from critic_adapters.common.testdata.vision import vision_batch

ids, mask, rows = vision_batch(tiny_config("qwen2_vl"), [[(1, 4, 4)], [], [(1, 2, 4), (1, 4, 4)]], seed=0)
texts = images = None
def processor(text, images, return_tensors, padding):
    media = [r for r in rows if r]
    return {"input_ids": ids, "attention_mask": mask, "pixel_values": torch.cat([r["pixel_values"] for r in media]),
            "image_grid_thw": torch.cat([r["image_grid_thw"] for r in media])}
"""
    check = """
assert values.shape == ids.shape
zeroed = [r and dict(r, pixel_values=torch.zeros_like(r["pixel_values"])) for r in rows]
assert not torch.allclose(values[0], compute_values(critic, ids, mask, multi_modal_inputs=zeroed)[0])  # the pixels count
assert torch.equal(values, compute_values(critic, ids, mask, multi_modal_inputs=rows))
try:  # the same rows without their images: refused by row, never computed blind
    compute_values(critic, ids, mask)
    raise AssertionError("placeholders without images were computed")
except ValueError as error:
    assert str(error).startswith("row 0: input_ids hold 4 image placeholder token(s)"), error
"""
    code = prelude + example.replace('"Qwen/Qwen2.5-VL-3B-Instruct"', repr(model)) + check
    result = subprocess.run([sys.executable, "-c", code], env=worker_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_the_ray_example_runs(tmp_path):
    """The README's RayCriticGroup block, on a local cluster (token authentication off in this test's
    own environment, its ~/.ray in tmp_path)."""
    # The runnable one, the README's (the placement-group sketch in docs/OFFLOAD.md needs a host's objects).
    (example,) = [block for block in readme_blocks("python") if "RayCriticGroup" in block and "ray.init" in block]
    model_dir = str(tmp_path / "model")
    from critic_adapters.common.testdata import save_tiny_causal_lm

    save_tiny_causal_lm("qwen2", model_dir)
    code = example.replace("path/to/critic", model_dir)
    prelude = ("from critic_adapters.tests.conformance.worker import rollout\nrollout_batch = rollout(0)\n"
               "input_ids, attention_mask = rollout_batch.input_ids, rollout_batch.attention_mask\n")
    check = ("\nassert values.shape == tuple(input_ids.shape) and extra == {'step': 1}\n"
             "assert metrics['value_loss'] > 0\nray.shutdown()\n")
    env = worker_env(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", HOME=str(tmp_path))
    result = subprocess.run([sys.executable, "-c", prelude + code + check], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert (tmp_path / "critic" / "config.json").is_file() and (tmp_path / "ckpt").is_dir()


if __name__ == "__main__":
    run_pytest(__file__)
