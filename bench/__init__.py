"""Side-by-side benchmarks of epd-pipeline against the budgets in docs/design.md.

Run ``python -m bench [NAME ...] [--quick] [--out DIR]`` (``make bench`` runs it on local
services); see ``bench/README.md`` for what each benchmark measures and how to read it.
"""
