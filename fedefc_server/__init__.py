"""Server side of FedEFC on Flower: strategy, prestopping, ServerApp and launcher."""
