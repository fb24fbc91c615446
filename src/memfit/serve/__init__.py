"""``memfit serve``: an AUTOMATIC1111-compatible HTTP API and a web page over a warm memfit Session.

Needs the optional extra: ``pip install memfit[serve]`` (FastAPI and uvicorn). ``import memfit``
never imports this package.
"""

from memfit.serve.app import Limits, Txt2ImgRequest, create_app

__all__ = ["Limits", "Txt2ImgRequest", "create_app"]
