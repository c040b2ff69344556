"""The tensor plane: tensors as gRPC chunk streams (wire format, codec, TensorStore server and client).

Importing this package does not import torch; its modules do.
"""
