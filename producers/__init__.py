"""The ingress: render, fan-out, the intake every front submits through, the router of
``epd.render`` and the in-process submitter."""
