"""The job plan's activations (common.engine.memory: a meta-device forward's saved-for-backward count) against
what a real update saves (bench/tensor_bytes.py), at three token budgets, with and without gradient
checkpointing, on two families: within 15%. (Its parameter, gradient and optimizer bytes are compared with
resident_bytes() exactly where engines are built anyway: tests/conformance, test_hsdp, test_lora.)"""

import json
import os
import subprocess
import sys

import pytest

from critic_adapters.common.tests.helpers import run_pytest, skip_without_backend


@pytest.mark.parametrize("backend,family", [("fsdp", "qwen2"), ("fsdp", "llama"), ("veomni", "qwen2"),
                                            ("megatron", "qwen2")])
def test_planned_activations_are_within_15_percent_of_a_real_steps(tmp_path, backend, family):
    skip_without_backend(backend)
    out = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    result = subprocess.run([sys.executable, "-m", "critic_adapters.tests.memory_plan_worker", backend, family,
                             str(tmp_path), str(out)], capture_output=True, text=True, timeout=900,
                            env={**env, "PYTHONWARNINGS": "ignore"})
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 6
    for row in rows:
        assert row["planned"] is not None and row["saved"] > 0, row
        ratio = row["planned"] / row["saved"]
        assert 0.85 <= ratio <= 1.15, f"{backend} {family}: planned/saved = {ratio:.3f} at {row}"
    # The count grows with the tokens (a budget that changed nothing would make the check above hollow).
    plain = [row["saved"] for row in rows if not row["checkpointing"]]
    assert plain[0] < plain[1] < plain[2]


if __name__ == "__main__":
    run_pytest(__file__)
