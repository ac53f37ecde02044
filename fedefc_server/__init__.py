"""The ServerApp of FedEFC on Flower: the strategies, the prestopping rule and the round loop.

``server_app.py`` is the entry point; ``baselines/`` holds the servers of the methods
FedEFC is compared with. docs/ARCHITECTURE.md maps every module.
"""
