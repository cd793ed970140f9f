"""``modules.api.api.Api``: the WebUI's HTTP API object (A1111 1.10's contract).

``webui.py`` creates it only when the API is served (``--api``; ``--nowebui`` serves nothing
else), on the app gradio made, and keeps no reference to it: its routes' endpoints are its
bound methods. ``add_api_route`` registers a route on that app and, with ``--api-auth
user:pass[,user:pass...]``, puts the HTTP Basic check (``auth``) in front of it: a request
without those credentials gets 401 with ``WWW-Authenticate: Basic``. Without ``--api-auth``
every route is open, whatever ``--gradio-auth`` says (gradio checks its own routes only).
"""

from secrets import compare_digest

from fastapi import Depends, HTTPException
from fastapi.security import HTTPBasic, HTTPBasicCredentials

from modules import shared

BASIC = Depends(HTTPBasic())  # the Authorization header's user and password, or 401


class Api:
    def __init__(self, app, queue_lock):
        logins = getattr(shared.cmd_opts, "api_auth", None)
        if logins:
            self.credentials = dict(pair.split(":") for pair in logins.split(","))
        self.app, self.queue_lock = app, queue_lock
        self.add_api_route("/sdapi/v1/sd-models", self.get_sd_models, methods=["GET"])

    def add_api_route(self, path, endpoint, **kwargs):
        if getattr(shared.cmd_opts, "api_auth", None):
            return self.app.add_api_route(path, endpoint, dependencies=[Depends(self.auth)],
                                          **kwargs)
        return self.app.add_api_route(path, endpoint, **kwargs)

    def auth(self, credentials: HTTPBasicCredentials = BASIC):
        known = self.credentials.get(credentials.username)
        if known is not None and compare_digest(credentials.password, known):
            return True
        raise HTTPException(401, "Incorrect username or password",
                            headers={"WWW-Authenticate": "Basic"})

    def get_sd_models(self):
        """The checkpoints (here: the loaded model's class name, or nothing)."""
        model = shared.sd_model
        return [] if model is None else [{"title": type(model).__name__}]
