"""An EC connector for vLLM over this project's embedding stores (``redis://``,
``redis+cluster://``, ``shm://``).

vLLM 0.33 loads it by module path::

    --ec-transfer-config '{"ec_connector": "EPDStoreECConnector",
                           "ec_connector_module_path": "epd_vllm_ec.connector", ...}'

A producer (encoder instance) writes each encoder output under the key, dtype and framing our
own encode worker uses, and answers the request with signed ``ec_transfer_params`` entries; a
consumer (prefill instance) loads an item by its ``mm_hash`` only when the request carries an
entry for it that verifies (our secret, our store, our model fingerprint, not expired). So
embeddings made by our encode workers feed a vLLM prefill instance, and the other way round.

Only :mod:`epd_vllm_ec.connector` imports vLLM; the rest (settings, keys and entries, framing,
the store thread) is plain code the project's tests exercise without it. Nothing else of ours
imports this package (``lint-imports`` holds that).
"""
