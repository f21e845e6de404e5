"""Which share of a matrix a run decodes: the rotating seed the corpus tests use.

`SPECDEC_CORPUS_SEED` (default: the day number, printed in the summary) picks it, so two
consecutive seeds cover every cell of a halved matrix, and a failure is reproducible from the
seed. `SPECDEC_FULL_MATRIX=1` decodes every cell (a release check, or a bisect).
"""

from __future__ import annotations

import datetime
import os
import zlib
from collections.abc import Sequence
from typing import TypeVar

T = TypeVar("T")

SEED = int(os.environ.get("SPECDEC_CORPUS_SEED") or datetime.date.today().toordinal())
FULL = os.environ.get("SPECDEC_FULL_MATRIX") == "1"


def half(cells: Sequence[T], *key: str) -> list[T]:
    """Half of `cells` (every one under `SPECDEC_FULL_MATRIX=1`), which half a function of
    `key` and the seed: two consecutive seeds decode them all."""
    if FULL:
        return list(cells)
    at = zlib.crc32("/".join(key).encode()) + SEED
    return [c for i, c in enumerate(cells) if (i + at) % 2 == 0]


def runs(*key: str) -> bool:
    """Whether the cell named `key` runs under this seed (every other seed; always under
    `SPECDEC_FULL_MATRIX=1`)."""
    return FULL or (zlib.crc32("/".join(key).encode()) + SEED) % 2 == 0
