"""VeOmni critic engine (build_foundation_model + FSDP2 through VeOmni), checkpointing and launcher."""
