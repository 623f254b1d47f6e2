"""Cross-backend tests: parity between engines, checkpoint interchange, vendoring."""
