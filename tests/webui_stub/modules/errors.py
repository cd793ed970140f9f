import sys
import traceback

reported: list[str] = []


def report(message, *, exc_info=False):
    """Print like the WebUI does (hook errors are reported, never raised)."""
    reported.append(message + ("\n" + traceback.format_exc() if exc_info else ""))
    for line in message.splitlines():
        print("***", line, file=sys.stderr)
    if exc_info:
        print(traceback.format_exc(), file=sys.stderr)
