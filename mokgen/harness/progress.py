"""Progress bars: tqdm where installed, else one line per step (no hard dependency)."""
from __future__ import annotations

import sys
import time


def progress(items, desc: str):
    items = list(items)
    try:
        from tqdm import tqdm

        yield from tqdm(items, desc=desc, file=sys.stderr)
        return
    except ImportError:
        pass
    t0 = time.perf_counter()
    for i, item in enumerate(items):
        print(f"{desc}: {i + 1}/{len(items)} ({time.perf_counter() - t0:.1f} s)",
              file=sys.stderr, flush=True)
        yield item
