"""The OpenAI-compatible front: ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/models``,
on the same intake, tenants, admission, limits and status records as the native API.

``models`` holds the wire shapes (pydantic, documented in ``/openapi.json``), ``errors`` the
error shape, ``inputs`` turns a body into a submission's parts, ``submit`` hands it to the
intake and waits, ``views`` builds OpenAI's objects from a status record, ``stream`` writes
the server-sent chunks.
"""
