"""critic-adapters common code: the value-head module, value loss and batching shared by all backends.

Importing `common` itself imports nothing; its submodules import torch and transformers (trl only
lazily, in common.valuehead.trl_compat, when it is installed), and never a training backend.
"""
