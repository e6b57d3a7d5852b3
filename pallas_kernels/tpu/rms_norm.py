"""Pallas TPU kernel: rms_norm (in progress)."""
