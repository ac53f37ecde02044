"""Client side of FedEFC on Flower: the NumPyClient and the ClientApp."""
