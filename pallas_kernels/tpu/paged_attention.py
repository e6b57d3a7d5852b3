"""Pallas TPU kernel: paged_attention (in progress)."""
