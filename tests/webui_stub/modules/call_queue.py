"""How the UI runs a generation: an exception is reported in the console (with its traceback)
and shown to the user as ``<div class='error'>ClassName: message</div>`` in place of the
images' HTML info (contract: the UI's call wrapper)."""

import html
import threading

from modules import errors

# The WebUI runs one job at a time under this lock (a FIFO lock in the WebUI).
queue_lock = threading.Lock()


def wrap_gradio_call(func):
    def f(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (the UI reports every error)
            errors.report("Error completing request", exc_info=True)
            return f"<div class='error'>{html.escape(f'{type(e).__name__}: {e}')}</div>"
    return f
