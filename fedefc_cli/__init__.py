"""The ``fedefc`` command: simulation runs, grids and their reports, deployment.

Tooling around the Flower app, never shipped inside it (the app package Flower builds
holds ``common``, ``fedefc_server`` and ``fedefc_client`` only). ``main.py`` is the
command line; docs/ARCHITECTURE.md maps the rest.
"""
