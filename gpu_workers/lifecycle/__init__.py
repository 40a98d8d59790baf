"""The request lifecycle of the prefill and decode workers, apart from compute.

A request that reaches a GPU worker goes through the same phases whichever worker runs it:
admission (:mod:`.admission`: validation, the request's record, cancel flag, deadline and
bounds), the embedding wait (:mod:`.embeddings`: readiness, the wait and its rechecks), and its
outcome (:mod:`.outcomes`). :mod:`.record_watch` stops a request whose status record went while
it decoded. :class:`RequestLifecycle` (:mod:`.parts`) builds the pieces once for a worker; the
workers (:mod:`gpu_workers.prefill`, :mod:`gpu_workers.decode`) compose them with the compute
layer (:mod:`gpu_workers.generation`, :mod:`gpu_workers.engine`, :mod:`gpu_workers.compute`).
"""
