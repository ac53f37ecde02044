"""Shared pieces of the FedEFC app: config, data, noise, partitions, models, math, loops."""
