"""The bad-input corpus, one module per command (tests/test_bad_input.py runs every row of CASES).

common: the row (Case), its context and outcome, the exit codes and the set-up helpers several commands share.
Each command's module holds its own rows in CASES and the helpers only its rows use; folders, outputs and
unprivileged hold the rows of one fault across every command (a model folder's files, the output rule, another
user). A new row goes into its command's module; case ids are unique across all of them (test_bad_input checks).
"""

from tests.bad_input import (
    bench,
    check,
    compare,
    deploy,
    eval,
    export,
    folders,
    generate,
    inspect,
    optimize,
    outputs,
    parity,
    serve,
    unprivileged,
)

MODULES = (export, optimize, generate, parity, bench, deploy, compare, check, eval, inspect, serve, folders, outputs)
MODULES += (unprivileged,)
CASES = [case for module in MODULES for case in module.CASES]
