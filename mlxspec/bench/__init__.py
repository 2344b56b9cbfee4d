"""`mlxspec bench`: every mode on every workload, interleaved, with paired ratios."""
