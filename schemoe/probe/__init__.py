"""Measuring this cluster for the cost model: `measure` fits a `Hardware` record from
micro-benchmarks (links, GEMMs, copies, codecs; measure.py) and real layer steps (calibrate.py).
`schemoe profile` (schemoe.profiler, a tool) runs it in full; the auto tuner (schemoe.autotune)
runs it quick, uncalibrated, when no profile of the run's key is stored. At the layer level:
it builds MoE layers to calibrate, and the tuner, at that level too, calls it."""
