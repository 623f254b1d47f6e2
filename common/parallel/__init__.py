"""Parallelism pieces: how rows and tokens are laid out over ranks and micro-batches.

Process groups and their failure-aware collectives (distributed), token-budget micro-batches
(batching), attention over packed sequences (packed_attention), megatron-style sequence parallelism
for transformers models (sequence_parallel), Ulysses (ulysses) and a sharded module's state in and
out over a group (shard_state). The bottom layer: it may import nothing else of common, only torch and
transformers.
"""
