"""One APIRouter per resource; each route parses its input and makes one library call."""
