"""The API's routes, one ``APIRouter`` per resource; state comes through ``frontend.api.deps``."""
