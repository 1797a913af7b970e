"""Tools that measure this cluster for the cost model: `schemoe profile` (measure.py: links,
GEMMs, copies, codecs; calibrate.py: real layer steps) and `simulate` / `validate` (cli.py)."""
