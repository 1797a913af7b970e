"""`schemoe profile` (measure this cluster with `schemoe.tuning.measure` and store the record
under the run's profile key), `simulate` (cli.py) and `validate` (validate.py)."""
