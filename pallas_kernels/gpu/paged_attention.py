"""Pallas GPU kernel: paged_attention (in progress)."""
