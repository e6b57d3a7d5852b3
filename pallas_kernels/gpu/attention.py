"""Pallas GPU kernel: attention (in progress)."""
