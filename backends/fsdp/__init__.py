"""FSDP2 (fully_shard) critic engine, checkpointing and launcher."""
