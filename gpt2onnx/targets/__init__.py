"""Deployment targets: one module per target, each declaring its SPEC (target: what a target is; all_targets: the
registry); deploy: the command that writes them into a folder. onnx and json only, never torch.
"""
