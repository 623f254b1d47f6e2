"""Worker of test_device_inputs: each backend's engine (a world of one) called with its inputs on
another device (OnAnotherDevice: what a GPU tensor is to code that mixes it with CPU tensors, on a
machine without one), against the same calls with CPU tensors. Writes WORKDIR/result.json.

  python -m critic_adapters.tests.device_inputs_worker MODEL_DIR WORKDIR BACKEND [BACKEND ...]

Per backend and method: {"result": true} when the values (update: value_loss and grad_norm) equal
those of the CPU inputs, or {"raised": the RuntimeError's message}.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
from torch.utils._pytree import tree_leaves

from critic_adapters.common.engine import RolloutBatch
from critic_adapters.common.engine.registry import build_engine
from critic_adapters.common.parallel.distributed import init_distributed, shutdown
from critic_adapters.tests.conformance.worker import engine_config, rollout


class OnAnotherDevice(torch.Tensor):
    """A CPU tensor that behaves, towards the code it meets, as one on cuda:0: it says so
    (`.device`), an operation mixing it with a CPU tensor of one or more dimensions raises as torch
    does across devices (a 0-d CPU tensor mixes, as with CUDA), and `.cpu()` / `.to("cpu")` give a
    plain CPU tensor. What comes out of an operation on it is on that device too."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func == torch.Tensor.device.__get__:  # (a new method-wrapper at each lookup: equal, not identical)
            return torch.device("cuda", 0)
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _to_cpu(args[1:], kwargs)):
            with torch._C.DisableTorchFunctionSubclass():
                return args[0].clone()
        leaves = [leaf for leaf in tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if any(type(leaf) is not cls and leaf.dim() > 0 for leaf in leaves):
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at least two devices, "
                               f"cuda:0 and cpu! ({getattr(func, '__name__', func)})")
        return super().__torch_function__(func, types, args, kwargs)


def _to_cpu(args, kwargs) -> bool:
    target = kwargs.get("device", args[0] if args else None)
    return isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu"


def elsewhere(value):
    if isinstance(value, RolloutBatch):
        return value.map(elsewhere)
    return value.as_subclass(OnAnotherDevice)


def _plain(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.as_subclass(torch.Tensor) if isinstance(tensor, OnAnotherDevice) else tensor


def _outcome(call) -> dict:
    try:
        return {"result": call()}
    except RuntimeError as err:  # what the first GPU run raised
        return {"raised": str(err)}


def calls(backend: str, config, dist) -> dict:
    """Each API method with inputs on the other device, then with the same inputs on the CPU (update:
    on a second engine built the same way)."""
    batch = rollout(0)
    ids, mask = batch.input_ids, batch.attention_mask
    out = {}
    engine = build_engine(backend, config, dist)
    try:
        for name, call in {"compute_values": lambda i, m: engine.compute_values(i, m),
                           "forward_backward": lambda i, m: engine.forward_backward(i, m)[0]}.items():
            out[name] = _outcome(lambda: torch.equal(_plain(call(elsewhere(ids), elsewhere(mask))), call(ids, mask)))
        out["update"] = _outcome(lambda: engine.update(elsewhere(batch)))
    finally:
        engine.close()
    if "result" in out["update"]:
        twin = build_engine(backend, config, dist)
        try:
            on_cpu = twin.update(batch)
        finally:
            twin.close()
        out["update"]["result"] = all(out["update"]["result"][k] == on_cpu[k] for k in ("value_loss", "grad_norm"))
    return out


def main(model_dir: str, workdir: str, *backends: str) -> None:
    warnings.filterwarnings("ignore")
    dist = init_distributed()
    results = {backend: calls(backend, engine_config(model_dir), dist) for backend in backends}
    with open(os.path.join(workdir, "result.json"), "w") as f:
        json.dump(results, f)
    shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
