"""Stand-in of ComfyUI's ``comfy`` package (see ../README.md)."""
