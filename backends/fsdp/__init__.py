"""FSDP2 (fully_shard) critic engine and launcher; the engine API, checkpoints and export are common/fsdp2_core.py's."""
