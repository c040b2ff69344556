"""The tensor plane: tensors as gRPC chunk streams (wire format, codec, TensorStore server and client).

Importing this package does not import torch; its modules do where it is installed. Without torch
(rlfleet-common installed without its ``torch`` extra, as the reward server is) the codec, the
TensorStore server and client carry numpy arrays instead (no bf16, no fp8); ``weight_sync`` needs torch.
"""
