"""Pallas GPU kernel: rms_norm (in progress)."""
