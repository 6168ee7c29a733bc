"""Write the configuration reference, `docs/reference/configuration.md`, from the dataclasses of
`pdserve/config.py`: every setting's name, type, default, `PDSERVE_*` variable and allowed values,
and its meaning from the docstring that follows the field (first paragraph in the table, the rest
below it).

    .venv/bin/python -m scripts.config_reference          # rewrite the page
    .venv/bin/python -m scripts.config_reference --check  # exit 1 when the page is stale

`tests/unit/test_config_reference.py` fails when the committed page differs from `render()`.
"""

import ast
import dataclasses
import inspect
import textwrap
import types
from pathlib import Path
from typing import Any, Union, get_args, get_origin, get_type_hints

from pdserve import config
from scripts.reference_page import one_line, write_or_check

PAGE = Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md"
COMMAND = ".venv/bin/python -m scripts.config_reference"
# The YAML sections in the order the page lists them.
SECTIONS: dict[str, type] = {"engine": config.EngineConfig, **config.SECTIONS}
SECTIONS["cluster"] = config.ClusterConfig
_TYPE_NAMES = {str: "string", int: "integer", float: "number", bool: "boolean"}

INTRO = """\
# Configuration reference

<!-- Generated from pdserve/config.py by `{command}`; do not edit. -->

Every setting of `pdserve up` and `pdserve generate`, generated from the dataclasses of
`pdserve/config.py`. Settings come from, each later source winning:

1. the YAML file (`--config FILE`), one mapping per section below;
2. environment variables: `PDSERVE_<SETTING>` for `engine` and `cluster` settings,
   `PDSERVE_<SECTION>_<SETTING>` for the other sections (the **variable** column);
3. command-line flags.

A `prefill:`, `decode:` or `mixed:` section may hold an `engine:` mapping that changes engine
settings for that role only, and `PDSERVE_<ROLE>_ENGINE_<SETTING>` (e.g.
`PDSERVE_DECODE_ENGINE_NUM_KV_BLOCKS`) sets one for that role; the rest come from `engine:`.
{shared} are set in `engine:` only: KV blocks move between roles byte for byte and the router
hashes prompts with the base engine's model, so every role shares them.

An unknown section, setting or `PDSERVE_*` variable (with the closest known name), a value of the
wrong type and a value outside a setting's choices stop `pdserve up` before Ray starts, with a
message that names the setting. A value of `null` (in YAML), or `none` / an empty string (in a
variable), unsets an optional setting. `deploy/config/local.yaml` sets every setting to its
default.
"""


def attribute_docstrings(cls: type) -> dict[str, str]:
    """Field name -> the docstring that follows the field in `cls`'s source (cleaned)."""
    (node,) = ast.parse(textwrap.dedent(inspect.getsource(cls))).body
    assert isinstance(node, ast.ClassDef)
    docs: dict[str, str] = {}
    for field, following in zip(node.body, node.body[1:], strict=False):
        if (
            isinstance(field, ast.AnnAssign)
            and isinstance(field.target, ast.Name)
            and isinstance(following, ast.Expr)
            and isinstance(following.value, ast.Constant)
            and isinstance(following.value.value, str)
        ):
            docs[field.target.id] = inspect.cleandoc(following.value.value)
    return docs


def render() -> str:
    """The page. Raises ValueError naming a setting without a docstring. Pure."""
    shared = ", ".join(f"`{name}`" for name in config.SHARED_ENGINE_FIELDS)
    parts = [INTRO.format(command=COMMAND, shared=shared)]
    for section, cls in SECTIONS.items():
        parts.append(_section(section, cls))
    return "\n".join(parts)


def _section(section: str, cls: type) -> str:
    docs = attribute_docstrings(cls)
    hints = get_type_hints(cls)
    rows, details = [], []
    for field in dataclasses.fields(cls):
        if section == "cluster" and field.name in SECTIONS:
            continue  # the other sections, listed on their own
        doc = docs.get(field.name)
        if not doc:
            raise ValueError(f"{cls.__name__}.{field.name} has no docstring: add one after it")
        summary, _, rest = doc.partition("\n\n")
        if field.name == "engine":  # a role's engine mapping
            kind, default = "mapping", "`{}`"
            variable = f"`{config.variable_name(f'{section}.engine', '<SETTING>')}`"
        else:
            kind = _kind(hints[field.name], config.choices_of(field))
            default = _default(field.default)
            variable = f"`{config.variable_name(section, field.name)}`"
        rows.append(f"| `{field.name}` | {kind} | {default} | {variable} | {one_line(summary)} |")
        if rest:
            details.append(f"- **`{field.name}`**: {one_line(rest)}")
    lines = [
        f"## {section}",
        "",
        one_line(inspect.cleandoc(cls.__doc__ or "")),
        "",
        "| setting | type | default | variable | meaning |",
        "| --- | --- | --- | --- | --- |",
        *rows,
        "",
    ]
    if details:
        lines += [*details, ""]
    return "\n".join(lines)


def _kind(hint: Any, choices: tuple[str, ...]) -> str:
    options = get_args(hint) if get_origin(hint) in (Union, types.UnionType) else (hint,)
    optional = type(None) in options
    if choices:
        text = "one of " + ", ".join(f"`{choice}`" for choice in choices)
    else:
        text = " or ".join(_TYPE_NAMES[option] for option in options if option is not type(None))
    return f"{text}, or `null`" if optional else text


def _default(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, int) and value >= 2**20 and value % 2**20 == 0:
        size = f"{value // 2**30} GiB" if value % 2**30 == 0 else f"{value // 2**20} MiB"
        return f"`{value}` ({size})"
    return f"`{value}`"


def main(argv: list[str] | None = None) -> int:
    return write_or_check(render, PAGE, COMMAND, __doc__ or "", argv)


if __name__ == "__main__":
    raise SystemExit(main())
