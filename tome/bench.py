"""``python -m tome.bench`` and the ``tome-bench`` command: the lab's benchmark
(``tome.lab.bench``; the measuring code lives in ``tome.lab``)."""

from __future__ import annotations

import sys

from .lab.bench import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
