"""The engine API takes its tensors on any device: every built-in backend's compute_values,
forward_backward and update, given inputs on "another device" (tests/device_inputs_worker.py's
OnAnotherDevice, on a machine without a GPU), return what the same CPU inputs give."""

import json

from critic_adapters.common.testdata import save_tiny_causal_lm
from critic_adapters.common.tests.helpers import run_pytest
from critic_adapters.common.tests.torchrun import run_torchrun


def test_inputs_on_another_device_give_what_cpu_inputs_give(tmp_path):
    """Issue 41, item 10: CUDA inputs (verl hands the engine its micro-batches on the GPU) crashed
    pack(): a CPU arange minus the CUDA row starts. The engines take their inputs to the CPU at
    entry (common.engine.inputs_on_host)."""
    model_dir = save_tiny_causal_lm("qwen2", str(tmp_path / "model"))
    run_torchrun(1, "critic_adapters.tests.device_inputs_worker", model_dir, str(tmp_path), "fsdp", "megatron",
                 "veomni", timeout=600)
    results = json.loads((tmp_path / "result.json").read_text())
    for backend in ("fsdp", "megatron", "veomni"):
        for method in ("compute_values", "forward_backward", "update"):
            assert results[backend][method] == {"result": True}, (backend, method, results[backend][method])


if __name__ == "__main__":
    run_pytest(__file__)
