"""Run by the WebUI at every start: check that torch is new enough. Installs nothing.

ToMe needs only torch, which the WebUI already has. It uses forward hooks with keyword
arguments, which came with torch 2.0. Silent when all is well (the WebUI prints any output).
"""

from importlib import metadata

MIN_TORCH = (2, 0)


def _version(text):
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


try:
    _torch = metadata.version("torch")
except metadata.PackageNotFoundError:
    print("ToMe: torch is not installed in the WebUI's environment; ToMe will not load.")
else:
    if _version(_torch) < MIN_TORCH:
        print(f"ToMe: torch {_torch} is too old; ToMe needs torch >= "
              f"{'.'.join(map(str, MIN_TORCH))}. Update the WebUI (v1.6+ ships torch 2.x) or "
              "start it once with --reinstall-torch.")
