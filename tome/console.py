"""One console line on a line of its own, for every host layer (the WebUI's and ComfyUI's)."""

from __future__ import annotations

import sys


def line(text: str) -> None:
    """Print ``text`` on a line of its own. While a sampler's progress bar (tqdm) is drawn,
    its line is finished first (a newline on the bar's stream), so the text never continues
    the bar's, in a terminal or in a log file; the bar redraws below it. What stderr holds is
    written first: a bar that just closed leaves its newline there unflushed (ComfyUI's log
    after a sampling)."""
    try:
        sys.stderr.flush()
    except (AttributeError, OSError, ValueError):
        pass
    try:
        from tqdm import tqdm
        streams = {id(fp): fp for bar in list(getattr(tqdm, "_instances", ()))
                   if (fp := getattr(bar, "fp", None)) is not None}
    except ImportError:
        streams = {}
    for fp in streams.values():
        try:
            fp.write("\n")
            fp.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing to finish
            pass
    print(text, flush=True)
