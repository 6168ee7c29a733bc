"""The configuration reference (docs/reference/configuration.md) is generated from config.py's
dataclasses: the committed page must be what the generator writes today."""

import dataclasses
import importlib.util
from pathlib import Path
from types import ModuleType

from pdserve import config

ROOT = Path(__file__).resolve().parents[2]


def _generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "config_reference", ROOT / "scripts" / "config_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_current() -> None:
    generator = _generator()
    page = generator.PAGE.read_text() if generator.PAGE.exists() else ""
    assert page == generator.render(), (
        f"{generator.PAGE.relative_to(ROOT)} is stale: run `{generator.COMMAND}` and commit it"
    )


def test_every_setting_is_documented_and_listed() -> None:
    """Every setting has a docstring (render() refuses one without) and a row with its
    variable; every class keeps its docstring."""
    generator = _generator()
    page = generator.render()
    for section, cls in generator.SECTIONS.items():
        docs = generator.attribute_docstrings(cls)
        assert cls.__doc__, cls
        assert f"## {section}\n" in page
        for name in config.settings_of(cls):
            assert docs.get(name), f"{cls.__name__}.{name} has no docstring"
            assert f"| `{config.variable_name(section, name)}` |" in page
    assert set(generator.SECTIONS) == {"engine", "cluster", *config.SECTIONS}


def test_a_field_without_a_docstring_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Undocumented:
        """A section."""

        documented: int = 1
        """One."""
        bare: int = 2

    generator = _generator()
    assert generator.attribute_docstrings(Undocumented) == {"documented": "One."}
    try:
        generator._section("undocumented", Undocumented)
    except ValueError as e:
        assert "Undocumented.bare has no docstring" in str(e)
    else:
        raise AssertionError("a setting without a docstring was rendered")
