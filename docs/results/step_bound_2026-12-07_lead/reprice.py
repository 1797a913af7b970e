"""This run's and run 2's step grids re-priced three ways (everything else the same profile):
as fitted; with skew = 0; and with each stage's gradients as one transfer posted after its last
AT backward (no pieces, no lead: the stack model before 22aa181, buckets still sharing the
link). Each grid's median |error| of the simulated steps and auto's choice (the fastest
predicted plan; ties: the first row, as bench step's auto) measured against the best row.

    python docs/results/step_bound_2026-12-07_lead/reprice.py > docs/results/step_bound_2026-12-07_lead/reprice.txt
"""

import importlib.util
from dataclasses import replace
from unittest import mock

from schemoe.costmodel import stack

# The skew run's reprice.py: its `report` (and through it the grid reader); its main is guarded.
_spec = importlib.util.spec_from_file_location(
    "skew_reprice", "docs/results/step_bound_2026-12-07_skew/reprice.py"
)
skew_reprice = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(skew_reprice)


def whole_stages(groups, piece_bytes):
    """Each group as one transfer, posted when the stage's last AT backward ends."""
    return [(b, n, 0.0) for b, n in groups]


grids = "docs/results/step_bound_2026-12-07_lead*/*_2x?.txt"
skew_reprice.report(grids, [("fitted", lambda h: h), ("skew 0", lambda h: replace(h, skew=0.0))])
print()
with mock.patch.object(stack, "_pieces", whole_stages):
    skew_reprice.report(grids, [("no pieces", lambda h: h)])
