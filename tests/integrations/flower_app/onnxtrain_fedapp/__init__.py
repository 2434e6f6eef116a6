"""Federated digits CNN on onnxtrain's on-device API, as a Flower App."""
