"""The servers of FedCorr, FedNoRo and RoFL: method server hooks with work between rounds
and messages outside them (docs/BASELINE-METHODS.md). The other methods need no server of
their own: FedAvg, FedProx and FedDitto use :class:`fedefc_server.method_server.MethodServer`,
forward correction and confident learning
:class:`fedefc_server.prestopping_server.PrestoppingServer` (common/methods.py names each).
"""
