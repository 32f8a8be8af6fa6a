"""The HTTP routes, one APIRouter per route group; `serve.app.create_app` includes them all."""
