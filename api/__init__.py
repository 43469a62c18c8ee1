"""The FastAPI service (REST submission, SQL queue, dispatchers)."""
