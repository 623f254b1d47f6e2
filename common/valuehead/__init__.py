"""The shared value-head module: load any critic checkpoint, compute per-token values, save.

Public API (a contract other code and users rely on):
  load_critic, LoadReport, compute_values, save_critic, critic_config, trl_value_head_class,
  load_valuehead_model, select_attn_implementation, CriticLoadError.
CLI: python -m critic_adapters.common.valuehead {inspect,convert,values} ...
It may import common.parallel, common.learning, common.storage and common.testdata, never the
engine layer or a backend.
"""

from .attention import select_attn_implementation
from .config import critic_config
from .errors import CriticLoadError
from .load import LoadReport, load_critic
from .save import save_critic
from .trl_compat import trl_value_head_class
from .values import compute_values
from .verl_compat import load_valuehead_model

__all__ = [
    "CriticLoadError",
    "LoadReport",
    "compute_values",
    "critic_config",
    "load_critic",
    "load_valuehead_model",
    "save_critic",
    "select_attn_implementation",
    "trl_value_head_class",
]
