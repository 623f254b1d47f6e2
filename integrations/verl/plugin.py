"""Registration with verl without importing verl's engines: what importing our verl package does.

verl's engine registry lives in `verl.workers.engine`, whose `__init__` imports every engine verl
ships (VeOmni's and megatron-core's among them, with their banners, warnings and transformers
patches, ~10 s). A stack that merely has us installed must not pay that in every verl process, so
importing critic_adapters.integrations.verl (or verl loading it as a plugin) only adds a finder to
`sys.meta_path`. When the process itself imports `verl.workers.engine` (verl's TrainingWorker
does), the finder

  - lets verl's package run unchanged, and right after it registers CriticAdaptersEngine.

(The CPU platform, cpu_platform.py, is put in place when our package is imported: the first of
verl's modules to ask for the platform fixes it, and several ask before verl.workers.engine.)

When `verl.workers.engine` is imported already, registration happens at once.
"""

from __future__ import annotations

import importlib.abc
import sys

ENGINE_PACKAGE = "verl.workers.engine"


def _register_now() -> None:
    from .engine import register

    register()


class _LoaderThen(importlib.abc.Loader):
    """A module's own loader, followed by `then(module)`."""

    def __init__(self, loader, then):
        self._loader, self._then = loader, then

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        self._then(module)


class _AfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)  # once: the other finders below find the module's own spec
        for finder in sys.meta_path:
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                spec.loader = _LoaderThen(spec.loader, self.then)
                return spec
        return None


def after_import(name: str, then) -> None:
    """then(module) once module `name` has been imported: now, if it has been; else right after the
    process imports it (the import itself is left to the process). Idempotent per name."""
    if name in sys.modules:
        then(sys.modules[name])
    elif not any(isinstance(finder, _AfterImport) and finder.name == name for finder in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(name, then))


def register_when_verl_engines_load() -> None:
    """Register CriticAdaptersEngine with verl's EngineRegistry once verl imports its engines (now,
    if it has); idempotent."""
    after_import(ENGINE_PACKAGE, lambda module: _register_now())
