"""`schemoe profile` (measure this cluster with `schemoe.probe` and store the record under the
run's profile key), `simulate` and `validate` (cli.py)."""
