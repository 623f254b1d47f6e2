"""critic-adapters common code: everything the backends share, in layers.

  parallel   process groups and collectives, micro-batches, packed attention, sequence splitting
  learning   the value loss, HL-Gauss values, rollout data and GAE
  storage    atomic directories and the checkpoint layout
  valuehead  the value-head module: load any critic checkpoint, per-token values, save
             (testdata, the tiny models of the tests and the embedded default, sits beside it)
  engine     the engine contract, registry, config and mesh, and the pieces engines are built from
  job        the launcher and the trainer's loop
A layer imports only itself and the layers listed before it (common/tests/test_layering.py checks it; each
package's docstring says what it is for). Importing `common` itself imports nothing; its
submodules import torch and transformers (trl only lazily, in common.valuehead.trl_compat, when it
is installed), and never a training backend.
"""

# Bottom to top; packages in one tuple are one layer (they may import each other).
LAYERS = (("parallel",), ("learning",), ("storage",), ("valuehead", "testdata"), ("engine",), ("job",))
