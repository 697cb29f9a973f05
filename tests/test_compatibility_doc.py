"""docs/compatibility.md agrees with the parser: every upstream flag its tables name is a flag
of ``vllm serve``, except the row of flags the parser refuses, which are not."""

from __future__ import annotations

import re
from pathlib import Path

from vllm.entrypoints.cli.main import make_parser

DOC = Path(__file__).resolve().parents[1] / "docs" / "compatibility.md"


def _flag_rows() -> list[tuple[list[str], str]]:
    """(flags in the first column, the second column) of the flag tables' rows."""
    rows = []
    for line in DOC.read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 2 and "`-" in cells[0]:
            rows.append((re.findall(r"`(-[-\w]+)", cells[0]), cells[1]))
    return rows


def test_every_documented_flag_is_parsed_or_refused_as_documented() -> None:
    serve = make_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    known = set(serve._option_string_actions)
    rows = _flag_rows()
    assert len(rows) > 20
    for flags, effect in rows:
        for flag in flags:
            if "unrecognized arguments" in effect:
                assert flag not in known, flag
            else:
                assert flag in known, flag
    documented = {f for flags, _ in rows for f in flags}
    for flag in (
        "-pp",
        "--api-key",
        "--no-trust-remote-code",
        "--mm-processor-kwargs",
        "--hf-overrides",
        "--override-generation-config",
        "--ssl-ca-certs",
        "--ssl-cert-reqs",
        "--disable-frontend-multiprocessing",
        "--swap-space",
        "--tokenizer-mode",
        "--revision",
        "--enable-lora",
        "--speculative-config",
    ):
        assert flag in documented, flag
