"""Data preparation and loading: FSDD download/prep, manifests, audio, batching.

Modules have one job each; import from them directly, e.g.
``from data.manifest import read_manifest``.
"""
