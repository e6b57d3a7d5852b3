"""Pallas GPU kernel: silu_mul (in progress)."""
