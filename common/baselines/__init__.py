"""The math of the methods FedEFC is compared with, and each one's own run-config keys.

One module per method (helpers shared by two methods have their own module); the
server and client halves of each method are in ``fedefc_server/baselines/`` and
``fedefc_client/baselines/``. docs/BASELINE-METHODS.md describes every one.
"""
