"""Progress bars for long operations (listing many objects, indexing, converting, writing, bench).

One rule everywhere: a bar is drawn on stderr when stderr is a terminal, never otherwise
(logs, CI, pipes stay clean), and never when the caller says ``enabled=False`` (the CLI's
``--quiet``).  tqdm draws it; a disabled bar costs a method call per update.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["progress"]


def progress(total: int | float | None = None, *, desc: str = "", unit: str = "it",
             enabled: bool | None = None, unit_scale: bool = False, **options: Any) -> Any:
    """A tqdm bar (use as a context manager; ``.update(n)``), drawn only when ``enabled`` is
    True, or when it is None and stderr is a terminal."""
    from tqdm.auto import tqdm

    if enabled is None:
        enabled = sys.stderr.isatty()
    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit_scale, disable=not enabled,
                file=sys.stderr, dynamic_ncols=True, leave=True, **options)
