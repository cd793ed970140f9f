"""``python -m tome.bench`` (and the ``tome-bench`` command): the short, stable name of the
lab's benchmark, ``tome.lab.bench``. Only an entry point: importing ``tome`` never loads it."""

from __future__ import annotations

import sys

from .lab.bench import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
