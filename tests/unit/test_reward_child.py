"""Loading spec.reward.function in the reward's child (reward_child.load_function): what a module
that cannot be imported says, told apart from a module whose own import is missing."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from rljob_worker.reward_child import load_function


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A package `team_rewards` on the path, as the image's site-packages would hold it (and
    forgotten after each test: the next one's lives in another tmp_path)."""
    package = tmp_path / "site" / "team_rewards"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "ok.py").write_text("def score(d, s, g, e):\n    return 1.0\n")
    (package / "symbolic.py").write_text(
        "import no_such_sympy\n\ndef score(d, s, g, e):\n    return 1.0\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    yield tmp_path / "site"
    for name in [n for n in sys.modules if n.partition(".")[0] == "team_rewards"]:
        del sys.modules[name]


@pytest.mark.parametrize(
    ("target", "missing"),
    [
        ("no_such_rewards", "no_such_rewards"),  # meant as no_such_rewards.py
        ("no_such_package.rewards", "no_such_package"),
        ("team_rewards.no_such_module", "team_rewards.no_such_module"),
    ],
)
def test_a_module_not_in_the_image_hints_at_file_paths(
    site: Path, target: str, missing: str
) -> None:
    with pytest.raises(ValueError) as info:
        load_function(f"{target}:score")
    assert str(info.value) == (
        f"no module {missing!r} in the image (a file path needs '/' or '.py')"
    )


def test_a_module_whose_own_import_is_missing_names_that_import(site: Path) -> None:
    with pytest.raises(ValueError) as info:
        load_function("team_rewards.symbolic:score")
    assert str(info.value) == (
        "team_rewards.symbolic imports 'no_such_sympy', which is not in the image (install it "
        "in an image FROM the worker image)"
    )
    assert load_function("team_rewards.ok:score")("", "", "", {}) == 1.0
