"""critic-adapters common code: the value-head module, value loss and batching shared by all backends.

Importing `common` imports only torch and transformers (and trl, lazily, when present); never a
training backend.
"""
