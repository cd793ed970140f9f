"""``modules.api``: the WebUI's HTTP API (``api.py``)."""
