"""Value learning: what a critic learns and from what.

The clipped value loss and its token alignment (loss), HL-Gauss distributional values (hl_gauss)
and rollout data: reading and validating rollout files, GAE returns, mini-batch splits (data).
Torch only; it may import common.parallel.
"""
