"""What users reach: the HTTP API (:mod:`frontend.api`) and its Python client
(:mod:`frontend.client`, which imports nothing else of ours)."""
