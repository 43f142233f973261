"""Measuring: the harness (interleaved rounds, machine and load), the bench subcommands, and compare on top."""
