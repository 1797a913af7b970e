import os
import sys

# The multi-rank tests import their shared helpers (moe_cases) in spawned processes too.
sys.path.insert(0, os.path.dirname(__file__))
