"""Proposal sources, one module per mode."""
