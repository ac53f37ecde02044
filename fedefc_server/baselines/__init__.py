"""The servers of FedCorr, FedNoRo and RoFL: strategies with work between rounds and
messages outside them (docs/BASELINE-METHODS.md). The other baselines need no server of
their own: FedAvg, FedProx and FedDitto use :class:`fedefc_server.strategy.FedAvgStrategy`,
forward correction and confident learning :class:`fedefc_server.fedefc_strategy.FedEFCStrategy`.
"""
