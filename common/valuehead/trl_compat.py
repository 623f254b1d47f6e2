"""The one place critic-adapters imports trl: find trl's value-head class wherever this trl keeps it.

trl moved AutoModelForCausalLMWithValueHead to trl.experimental.ppo in 0.26/0.27, dropped the
top-level alias in 0.29, and removed the class in 1.13. Our own critic never needs trl; this is
for interop (reading and checking trl checkpoints, and stacks that still wrap with trl).
"""

from __future__ import annotations

import importlib.metadata
import warnings

SUPPORTED_TRL = "trl>=0.27,<1.13"


def _import_from(module: str):
    with warnings.catch_warnings():
        # trl.experimental warns on every import; the location is exactly what this shim handles.
        warnings.simplefilter("ignore")
        mod = __import__(module, fromlist=["AutoModelForCausalLMWithValueHead"])
    return mod.AutoModelForCausalLMWithValueHead


def trl_value_head_class() -> type | None:
    """trl's AutoModelForCausalLMWithValueHead, from trl.experimental.ppo first, then top-level trl.

    None when trl is not installed or this trl has no such class (trl >= 1.13). Never raises.
    """
    for module in ("trl.experimental.ppo", "trl"):
        try:
            return _import_from(module)
        except (ImportError, AttributeError):
            continue
    return None


def installed_trl_version() -> str | None:
    try:
        return importlib.metadata.version("trl")
    except importlib.metadata.PackageNotFoundError:
        return None


def require_trl_value_head_class() -> type:
    """Like trl_value_head_class, but raises ImportError naming the installed trl and the fix."""
    cls = trl_value_head_class()
    if cls is None:
        version = installed_trl_version()
        have = f"trl {version} is installed and has no value-head class" if version else "trl is not installed"
        raise ImportError(
            f"this needs trl's AutoModelForCausalLMWithValueHead, but {have}; pip install '{SUPPORTED_TRL}'. "
            f"(critic-adapters' own critic does not need trl: use common.valuehead.load_critic.)"
        )
    return cls
