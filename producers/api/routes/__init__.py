"""The API's routes, one ``APIRouter`` per resource; state comes through ``producers.api.deps``."""
