"""The installed package's own check, run by tools/env-matrix in each environment from an empty
directory (so `critic_adapters` is the installed wheel, never the checkout):

  python tools/env_check.py BACKEND [BACKEND ...]

For each backend: the embedded tiny model written by the console script (`critic-adapters demo`), its
values from load_critic, and the same values from the backend's engine in a world of one (within
1e-5); the console script's `values`; the verl plugin entry point (and verl's registry where verl is
installed). Prints one JSON line, `env-check: {...}`, and exits 1 when a check failed.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import traceback


def _engine_matches_load_critic(backend: str, path: str) -> str:
    import torch

    from critic_adapters.common.engine.config import EngineConfig, ModelConfig
    from critic_adapters.common.engine.registry import build_engine
    from critic_adapters.common.parallel.distributed import init_distributed, shutdown
    from critic_adapters.common.valuehead import compute_values, load_critic

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 200, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 7:] = 0
    critic, _ = load_critic(path)
    with torch.no_grad():
        expected = compute_values(critic, ids, mask)
    engine = build_engine(backend, EngineConfig(model=ModelConfig(path=path)), init_distributed())
    try:
        got = engine.compute_values(ids, mask)
    finally:
        engine.close()
        shutdown()
    diff = float((got - expected).abs()[mask.bool()].max())
    if not diff <= 1e-5:
        raise AssertionError(f"{backend}'s engine values differ from load_critic's by {diff:.3g}")
    return f"max |diff| {diff:.2g}"


def main(backends: list[str]) -> int:
    import critic_adapters

    results: dict[str, object] = {"package": os.path.dirname(critic_adapters.__file__)}
    failed = False
    if "site-packages" not in results["package"]:
        results["installed"] = "FAILED: critic_adapters is not the installed package"
        failed = True
    console = os.path.join(os.path.dirname(sys.executable), "critic-adapters")
    with tempfile.TemporaryDirectory() as tmp:
        tiny = os.path.join(tmp, "tiny-model")
        demo = subprocess.run([console, "demo", tiny], capture_output=True, text=True, timeout=600)
        values = subprocess.run([console, "values", tiny, "--tokens", "1 22 642 7"], capture_output=True, text=True,
                                timeout=600)
        results["console"] = "ok" if demo.returncode == 0 and values.returncode == 0 else \
            f"FAILED: {(demo.stderr or values.stderr)[-300:]}"
        failed |= results["console"] != "ok"
        for backend in backends:
            try:
                results[f"engine:{backend}"] = _engine_matches_load_critic(backend, tiny)
            except Exception as err:  # noqa: BLE001 - reported, the other checks still run
                traceback.print_exc()
                results[f"engine:{backend}"] = f"FAILED: {type(err).__name__}: {str(err)[:300]}"
                failed = True
    plugins = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="verl.plugins")}
    results["verl_entry_point"] = "ok" if plugins.get("critic_adapters") == "critic_adapters.integrations.verl" else \
        f"FAILED: {plugins}"
    failed |= results["verl_entry_point"] != "ok"
    try:
        importlib.metadata.version("verl")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:  # verl loads its plugins when imported: the engine is in its registry
        from verl.workers.engine import EngineRegistry

        engine = EngineRegistry.get_engine_cls("value_model", "critic_adapters").__name__
        results["verl_registry"] = "ok" if engine == "CriticAdaptersEngine" else f"FAILED: {engine}"
        failed |= results["verl_registry"] != "ok"
    print("env-check: " + json.dumps(results), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:] or ["fsdp"]))
