"""`schemoe profile` (measure this cluster with `schemoe.probe` and store the record under the
run's profile key) and `simulate` (cli.py), `validate` (validate.py)."""
