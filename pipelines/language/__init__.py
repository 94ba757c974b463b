"""The language team: small sequence models trained sharded (FSDP2 or tensor parallel)."""
