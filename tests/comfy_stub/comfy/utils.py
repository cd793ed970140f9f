"""``comfy.utils.ProgressBar`` as ComfyUI 0.8.0 has it: a global hook receives
``(current, total, preview, node_id=...)`` on every update."""

PROGRESS_BAR_HOOK = None
EVENTS = []  # what the hook saw, for tests


def set_progress_bar_global_hook(function):
    global PROGRESS_BAR_HOOK
    PROGRESS_BAR_HOOK = function


class ProgressBar:
    def __init__(self, total, node_id=None):
        self.total, self.current, self.node_id = total, 0, node_id
        self.hook = PROGRESS_BAR_HOOK

    def update_absolute(self, value, total=None, preview=None):
        if total is not None:
            self.total = total
        self.current = min(value, self.total)
        EVENTS.append((self.current, self.total))
        if self.hook is not None:
            self.hook(self.current, self.total, preview, node_id=self.node_id)

    def update(self, value):
        self.update_absolute(self.current + value)
