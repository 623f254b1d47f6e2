"""AReaL 1.0.4's own client code, for the tests of the service's AReaL routes.

areal pins torch < 2.11 and transformers <= 5.3, and importing any `areal.*` module runs its package
__init__, which imports some 25 packages (ray, hydra, omegaconf, flask, ...). So the tests never
install or import areal as a package: tools/setup.sh puts its files in .overlays/areal-1.0.4, and
load() runs exactly the modules an AReaL critic client runs, from those files:

  areal/infra/rpc/serialization.py                            serialize_value / deserialize_value
  areal/experimental/training_service/controller/controller.py  GatewayTrainController (HTTP calls)
  areal/trainer/ppo/critic.py                                 PPOCriticControllerV2 (its critic routes)
  areal/utils/functional/functional.py                        ppo_critic_loss_fn (the loss it trains with)
  areal/utils/seqpack.py                                      ffd_allocate (how it splits an update's rows)

Every `areal` package above them is an empty stand-in (no __init__ runs, and no other areal module can
load by accident: a stand-in package has no path), and the names those files import from modules
they do not use on these paths (the engine-side classes, the executor of the controller's own
start-up, colorlog's logger) are stand-ins that say so when called.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
import types

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
OVERLAY = os.environ.get("CRITIC_AREAL_OVERLAY", os.path.join(REPO, ".overlays", "areal-1.0.4"))
REAL = {
    "areal.infra.rpc.serialization": "areal/infra/rpc/serialization.py",
    "areal.utils.seqpack": "areal/utils/seqpack.py",
    "areal.utils.functional.functional": "areal/utils/functional/functional.py",
    "areal.experimental.training_service.controller.controller":
        "areal/experimental/training_service/controller/controller.py",
    "areal.trainer.ppo.critic": "areal/trainer/ppo/critic.py",
}


def _unused(name: str):
    def call(*args, **kwargs):
        raise AssertionError(f"{name} is a stand-in: AReaL's critic client path was not expected to call it")
    call.__name__ = name.rsplit(".", 1)[-1]
    return call


class _Stand:
    """A class stand-in (an engine-side type a module names in a signature or a base list)."""


def _stand_ins() -> dict[str, dict]:
    """module name -> its attributes, for every module the REAL files import but do not run here."""
    identity_decorator = lambda *args, **kwargs: (lambda fn: fn)  # noqa: E731 - trace_perf(...)(fn) is fn

    class ModelAllocation:  # areal.api.alloc_mode: the controller reads .parallel of from_str(config.backend)
        def __init__(self, backend):
            self.backend, self.parallel = backend, None

        @classmethod
        def from_str(cls, backend):
            return cls(backend)

    return {
        "aiohttp": {},  # the controller's own start-up (not run: the gateway address is given)
        "numba": {"njit": lambda fn: fn},  # seqpack's one compiled helper, which ffd_allocate does not call
        "areal.utils.logging": {"getLogger": lambda name, *a, **k: logging.getLogger(f"areal.{name}")},
        "areal.infra.utils.concurrent": {"get_executor": _unused("get_executor"),
                                         "run_async_task": _unused("run_async_task")},
        "areal.infra.utils.http": {"create_httpx_client": _unused("create_httpx_client")},
        "areal.utils.network": {"format_hostport": lambda host, port: f"{host}:{port}"},
        "areal.api": {"TrainEngine": _Stand},
        "areal.api.alloc_mode": {"ModelAllocation": ModelAllocation},
        "areal.api.cli_args": {"MicroBatchSpec": _Stand, "PPOCriticConfig": _Stand,
                               "RejectionSamplingConfig": _Stand},
        "areal.infra": {"TrainController": _Stand},
        "areal.trainer.ppo.stats": {"infer_token_denominator": _unused("infer_token_denominator")},
        "areal.utils.stats_tracker": {"scope_func_wrapper": identity_decorator},  # engine-side PPOCritic's
        "areal.utils.data": {"batched_call": _unused("batched_call"), "KLEstimator": _Stand,
                             "split_padded_tensor_dict_into_mb_list": _unused("split_padded_tensor_dict_into_mb_list")},
        "areal.utils.perf_tracer": {"trace_perf": identity_decorator},
    }


def load() -> types.SimpleNamespace:
    """serialize_value, deserialize_value, GatewayTrainController, PPOCriticControllerV2,
    ppo_critic_loss_fn and ffd_allocate, AReaL 1.0.4's own (AssertionError naming setup when the overlay is missing)."""
    missing = [path for path in REAL.values() if not os.path.isfile(os.path.join(OVERLAY, path))]
    assert not missing, f"AReaL's files are missing from {OVERLAY} ({missing[0]}): run tools/setup.sh"
    if "areal.trainer.ppo.critic" not in sys.modules:
        packages = {name.rsplit(".", depth)[0] for name in [*REAL, *_stand_ins()] if name.startswith("areal")
                    for depth in range(1, name.count(".") + 1)}
        for name in sorted(packages):
            package = types.ModuleType(name)
            package.__path__ = []  # a stand-in package: nothing below it loads but what is placed here
            sys.modules.setdefault(name, package)
        for name, attributes in _stand_ins().items():
            module = types.ModuleType(name)
            module.__dict__.update(attributes)
            sys.modules[name] = module
        sys.modules["areal.utils"].stats_tracker = sys.modules["areal.utils.stats_tracker"]
        for name, path in REAL.items():
            spec = importlib.util.spec_from_file_location(name, os.path.join(OVERLAY, path))
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            spec.loader.exec_module(module)
            if name == "areal.utils.functional.functional":  # what its package's __init__ re-exports
                sys.modules["areal.utils.functional"].ppo_critic_loss_fn = module.ppo_critic_loss_fn
    serialization = sys.modules["areal.infra.rpc.serialization"]
    return types.SimpleNamespace(
        serialize_value=serialization.serialize_value, deserialize_value=serialization.deserialize_value,
        GatewayTrainController=sys.modules["areal.experimental.training_service.controller.controller"]
        .GatewayTrainController,
        PPOCriticControllerV2=sys.modules["areal.trainer.ppo.critic"].PPOCriticControllerV2,
        ppo_critic_loss_fn=sys.modules["areal.utils.functional.functional"].ppo_critic_loss_fn,
        ffd_allocate=sys.modules["areal.utils.seqpack"].ffd_allocate)


def critic_client(url: str, api_key: str, *, timeout_s: float = 300):
    """AReaL's PPOCriticControllerV2 pointed at our service as its gateway: constructed as AReaL
    constructs it (a config with backend and request_timeout, a scheduler it does not call here), its
    initialize() not run (it would launch AReaL's own gateway, router, data proxy and workers), and
    the two attributes everything after initialisation reads set instead: the gateway's address and
    the user key."""
    areal = load()
    config = types.SimpleNamespace(backend="fsdp:d2", request_timeout=timeout_s, setup_timeout=timeout_s)
    client = areal.PPOCriticControllerV2("critic_adapters", config, scheduler=None)
    client._gateway_addr, client.api_key = url.rstrip("/"), api_key
    return client
