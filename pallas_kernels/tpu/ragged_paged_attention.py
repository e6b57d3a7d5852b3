"""Pallas TPU kernel: ragged_paged_attention (in progress)."""
