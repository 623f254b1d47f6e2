"""Our critic as a verl engine: `critic.strategy=critic_adapters` in verl 0.9.1's TrainingWorker.

Importing this package registers the engine with verl (EngineRegistry, model_type value_model,
backend critic_adapters, devices cpu / cuda / npu):

    import critic_adapters.integrations.verl  # noqa: F401  (in every process that builds a critic)

engine.py has what the engine does, config.py how verl's critic configs map onto ours, and
cpu_platform.py the CPU platform verl lacks (installed on import on a machine without GPUs). verl itself is optional: it needs transformers < 5.11
(tools/setup.sh installs it as an overlay, .overlays/verl-0.9.1, for the tests).
"""

try:
    import verl  # noqa: F401
except ImportError as err:
    raise ImportError(f"critic_adapters.integrations.verl needs verl 0.9.1 ({err}); it runs with transformers < 5.11: "
                      f"pip install 'verl==0.9.1' 'transformers>=5.5.3,<5.11' 'tensordict<=0.10.0' in the stack's "
                      f"environment (tools/setup.sh builds .overlays/verl-0.9.1 for the tests)") from None

from .cpu_platform import install_if_no_accelerator  # noqa: E402

install_if_no_accelerator()  # before verl.workers is imported (cpu_platform.py says why)

from .config import CriticAdaptersEngineConfig, engine_config_from_verl  # noqa: E402
from .engine import CriticAdaptersEngine, register  # noqa: E402

register()

__all__ = ["CriticAdaptersEngine", "CriticAdaptersEngineConfig", "engine_config_from_verl", "register"]
