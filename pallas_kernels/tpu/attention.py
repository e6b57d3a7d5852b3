"""Pallas TPU kernel: attention (in progress)."""
