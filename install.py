"""Run by the WebUI at every start: check that torch is new enough. Installs nothing.

ToMe needs only torch, which the WebUI already has (the minimum is in
``tome/requirements.py``). Silent when all is well (the WebUI prints any output).
"""

import os
import runpy
from importlib import metadata

_req = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "tome",
                                   "requirements.py"))
try:
    _torch = metadata.version("torch")
except metadata.PackageNotFoundError:
    print("ToMe: torch is not installed in the WebUI's environment; ToMe will not load.")
else:
    _problem = _req["torch_problem"](_torch)
    if _problem:
        print(f"ToMe: {_problem}")
