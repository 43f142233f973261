"""A model folder's files read by every command that reads one (one generator of rows per fault, a row per command)."""

from __future__ import annotations

from tests.bad_input.common import BENCH_QUICK, GEN, B, Case, data_location, export_copy, manifest_edit

CASES: list[Case] = [
    # -- security: paths inside files ---------------------------------------------------------------------------
    *(
        Case(
            f"data-dotdot-{cmd}",
            "security",
            (cmd, "m", *args),
            B,
            data_location("../outside.bin"),
            match="not a plain file name",
        )
        for cmd, args in (
            ("generate", GEN),
            ("inspect", ()),
            ("parity", ("--cases", "1")),
            ("bench", BENCH_QUICK),
            ("deploy", ("--target", "triton", "-o", "out")),
            ("optimize", ("-o", "out")),
        )
    ),
    *(
        Case(
            f"manifest-{key}-garbage-{cmd}",
            "traceback",
            (cmd, "m", *args),
            (0, B),  # shown as unreadable, or refused in one line: never an internal error
            export_copy(manifest_edit(**{key: value})),
            match="unreadable",
        )
        for key, value in (("parity", "garbage"), ("fusion", [1, 2]), ("fp16", 7), ("deploy", "x"))
        for cmd, args in (("inspect", ()), ("generate", GEN))
    ),
]
