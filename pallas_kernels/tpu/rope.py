"""Pallas TPU kernel: rope (in progress)."""
