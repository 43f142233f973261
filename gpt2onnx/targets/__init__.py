"""Deployment targets: one module per target, each declaring its SPEC (registry: what a target is, and the
list of them); deploy: the command that writes them into a folder. onnx and json only, never torch.
"""
