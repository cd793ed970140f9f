"""What the extension needs from its host, in one torch-free place.

``install.py`` loads this file by path (it runs before anything of ``tome`` may be imported),
``tome.webui.check_torch`` imports it, and a test keeps ``pyproject.toml`` in step.
"""

# Forward hooks with keyword arguments (how blocks are patched) came with torch 2.0.
MIN_TORCH = (2, 0)


def version_tuple(text: str) -> tuple[int, int]:
    """``"2.1.2+cu121"`` -> ``(2, 1)``."""
    parts = []
    for piece in text.split("+")[0].split(".")[:2]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def torch_problem(version: str) -> str | None:
    """The console message for a torch that is too old, or None."""
    if version_tuple(version) >= MIN_TORCH:
        return None
    return (f"ToMe needs torch >= {'.'.join(map(str, MIN_TORCH))}; this WebUI runs torch "
            f"{version}. Update the WebUI (v1.6+ ships torch 2.x) or start it once with "
            "--reinstall-torch.")
