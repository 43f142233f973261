"""The preflight: whether a folder or a planned export works with a runtime, a target, a strategy and the engine
(check), and the compatibility matrix of every combination (matrix)."""
