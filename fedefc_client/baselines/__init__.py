"""The local updates of the methods FedEFC is compared with, one module per method
(docs/BASELINE-METHODS.md); each is a function of a :class:`fedefc_client.job.LocalJob`.
"""
