"""What the generated reference pages share: writing the page, or checking it is current."""

import argparse
import sys
from collections.abc import Callable
from pathlib import Path


def one_line(text: str) -> str:
    """`text` as one Markdown table cell."""
    return " ".join(text.split()).replace("|", "\\|")


def write_or_check(
    render: Callable[[], str], page: Path, command: str, doc: str, argv: list[str] | None
) -> int:
    """Write `render()` to `page`, or with `--check` exit 1 when `page` differs from it."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when the page is stale")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        if not page.exists() or page.read_text() != text:
            print(f"{page} is stale: run `{command}`", file=sys.stderr)
            return 1
        return 0
    page.parent.mkdir(parents=True, exist_ok=True)
    page.write_text(text)
    print(f"wrote {page}")
    return 0
