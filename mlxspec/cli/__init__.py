"""The `mlxspec` command line (click)."""
