"""Our critic as a verl engine: `critic.strategy=critic_adapters` in verl 0.9.1's TrainingWorker.

Importing this package (verl imports it as a plugin, through the `verl.plugins` entry point) imports
nothing of verl's engines and none of our backends: it arranges for the engine to be registered with
verl (EngineRegistry, model_type value_model, backend critic_adapters, devices cpu / cuda / npu)
when verl itself imports its engines (plugin.py says how), and a backend is imported only when
verl builds an engine of it:

    import critic_adapters.integrations.verl  # noqa: F401  (in every process that builds a critic)

engine.py has what the engine does, config.py how verl's critic configs map onto ours, and
cpu_platform.py the CPU platform verl lacks (put in place on import, on a machine without GPUs). verl itself is optional: it needs transformers < 5.11 (tools/setup.sh
installs it as an overlay, .overlays/verl-0.9.1, for the tests).
"""

import importlib.util

if importlib.util.find_spec("verl") is None:
    raise ImportError("critic_adapters.integrations.verl needs verl 0.9.1, which is not installed; it runs with "
                      "transformers < 5.11: pip install 'verl==0.9.1' 'transformers>=5.5.3,<5.11' "
                      "'tensordict<=0.10.0' in the stack's environment (tools/setup.sh builds .overlays/verl-0.9.1 "
                      "for the tests)")

from .cpu_platform import install_if_no_accelerator  # noqa: E402
from .plugin import register_when_verl_engines_load  # noqa: E402

# Before anything of verl's asks for its platform (the first ask fixes it: cuda, on a machine
# without GPUs); verl.plugin.platform imports no engine.
install_if_no_accelerator()
register_when_verl_engines_load()

# Imported on first use: engine.py imports verl's engines, config.py verl's configs.
_LAZY = {"CriticAdaptersEngine": ".engine", "register": ".engine",
         "CriticAdaptersEngineConfig": ".config", "engine_config_from_verl": ".config"}
__all__ = sorted(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
