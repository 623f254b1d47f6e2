"""FSDP2 (fully_shard) critic engine and launcher; the engine API, checkpoints and export are common/engine/fsdp2_core.py's."""
