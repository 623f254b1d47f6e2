"""VeOmni critic engine (build_foundation_model + FSDP2 through VeOmni) and launcher; the engine API,
checkpoints and export are common/engine/fsdp2_core.py's."""
