"""How hard the fault suite pushes: a quick version for `make test-faults` (and CI), a long one
for `make test-faults-long`.

TANDEM_FAULTS=long (set by `make test-faults-long`) selects the long version; anything else the quick one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Scale:
    name: str
    fuzz_examples: int  # hypothesis examples per fuzz test
    cancelled_streams: int  # streams cancelled in the cancellation storm
    storm_concurrency: int  # streams open at once during the storm
    flood_streams: int  # concurrent streams thrown at a frontend admitting `flood_limit`
    soak_seconds: float  # mixed workload duration (0: the soak is not part of this version)


QUICK = Scale("quick", fuzz_examples=25, cancelled_streams=100, storm_concurrency=16, flood_streams=80,
              soak_seconds=0)
LONG = Scale("long", fuzz_examples=200, cancelled_streams=1600, storm_concurrency=32, flood_streams=400,
             soak_seconds=180)

SCALE = LONG if os.environ.get("TANDEM_FAULTS", "").lower() == "long" else QUICK
