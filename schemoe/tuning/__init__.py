"""Tuning: choosing what a layer or a step runs. The entry points are `AutoTuner` (auto.py),
which resolves layers with policy "auto" / "search", and `Replanner` (replan.py), which changes
every layer's plan between steps from its live routing (picture.py prices that routing,
switch.py records the switches); plan.py holds what a run plans on (the Hardware record of its
key, rank 0's decision shared), micro.py the micro-chunk count, choose.py the cost model's
search over configurations, measure.py / calibrate.py the quick and full profiles of this
cluster (`schemoe profile` runs them in full)."""
