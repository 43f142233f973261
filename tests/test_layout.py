"""tests/ mirrors the package's rooms (tests/README.md): a folder of tests is named after the package folder whose
code its files mainly test, the helper folders hold no tests, and no two test files share a name (pytest's default
import mode imports each test file by its bare name, from its own folder)."""

from collections import Counter
from pathlib import Path

TESTS = Path(__file__).resolve().parent
PACKAGE = TESTS.parent / "gpt2onnx"
HELPERS = {"bad_input", "fixtures", "js", "workers"}  # the corpus, committed models, Node, other venvs' scripts
SKIPPED = {"__pycache__", "node_modules"}


def found_test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if not SKIPPED & set(p.relative_to(TESTS).parts))


def test_each_folder_of_tests_names_a_room_of_the_package():
    folders = {p.parent.relative_to(TESTS) for p in found_test_files()} - {Path(".")}
    assert folders, "no test file below tests/"
    for folder in sorted(folders):
        room = PACKAGE / folder
        assert (room / "__init__.py").is_file(), f"tests/{folder.as_posix()}/ names no package room (gpt2onnx/{folder})"


def test_the_helper_folders_hold_no_tests():
    for path in found_test_files():
        top = path.relative_to(TESTS).parts[0]
        assert top not in HELPERS, f"{path.relative_to(TESTS)}: a test in a helper folder; put it in its room"
    for helper in HELPERS:
        assert (TESTS / helper).is_dir(), f"tests/{helper}/ is gone: drop it from HELPERS"


def test_no_two_test_files_share_a_name():
    twice = [name for name, n in Counter(p.name for p in found_test_files()).items() if n > 1]
    assert not twice, f"test files with the same name in two folders: {twice}"


def test_one_conftest_at_the_top():
    """Test files import the shared helpers with ``from conftest import ...``: a second conftest.py in a room is
    a second module named ``conftest``, and whichever a worker imports first shadows the other (a layouts/
    conftest.py once failed 19 tests in CI that way, depending on which files a worker ran first)."""
    found = sorted(str(p.relative_to(TESTS)) for p in TESTS.rglob("conftest.py") if "node_modules" not in p.parts)
    assert found == ["conftest.py"], found
