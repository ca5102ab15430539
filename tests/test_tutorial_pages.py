"""How a tutorial page's console blocks are read and matched (tests/tutorial_pages.py)."""

from __future__ import annotations

from tests.tutorial_pages import mismatch, read_blocks

PAGE = """# A tutorial

```console
$ echo one && \\
  echo two
one
two
$ fedge-coordinator run --rounds 2
...
final test accuracy ... after 2 rounds (... bytes moved)
```

<!-- tutorial: long, numbers vary -->
```console
$ sudo fedge-lab up
```

```python
print("not a session")
```
"""


def test_blocks_commands_continuations_and_marks_are_read(tmp_path):
    page = tmp_path / "t.md"
    page.write_text(PAGE)
    first, second = read_blocks(page)
    assert [c.text for c in first.commands] == ["echo one && \\\n  echo two", "fedge-coordinator run --rounds 2"]
    assert first.commands[0].shown == ["one", "two"] and first.commands[0].line == 4
    assert first.kind == "run" and second.kind == "long" and second.commands[0].shown == []
    assert second.numbers_vary and not first.numbers_vary


def test_ellipses_match_what_varies_and_nothing_else():
    shown = ["...", "final test accuracy ... after 2 rounds (... bytes moved)"]
    assert mismatch(shown, "round 1\nround 2\nfinal test accuracy 0.8412 after 2 rounds (1,024 bytes moved)\n") == ""
    assert mismatch(shown, "final test accuracy 0.8412 after 3 rounds (1 bytes moved)") != ""
    assert mismatch(["one", "two"], "one\ntwo\n\n") == ""
    assert "did not print" in mismatch(["one", "three"], "one\ntwo")
    assert "does not show" in mismatch(["one"], "one\ntwo")
    assert mismatch([], "") == "" and mismatch([], "something") != ""


def test_numbers_vary_matches_any_number_and_only_numbers():
    shown = ["    1   0.6100  1.5598        -     4/4  212.9 KiB  3,234,048 bytes"]
    printed = "    1   0.5874  1.6012        -     4/4  213.0 KiB  3,301,112 bytes"
    assert mismatch(shown, printed, numbers_vary=True) == "" and mismatch(shown, printed) != ""
    assert mismatch(shown, printed.replace("KiB", "MiB"), numbers_vary=True) != ""
