"""The ClientApp of FedEFC on Flower: the NumPyClient, the local updates and the node's data.

``client_app.py`` is the entry point; ``baselines/`` holds the local updates of the
methods FedEFC is compared with. docs/ARCHITECTURE.md maps every module.
"""
