"""Pallas GPU kernel: rope (in progress)."""
