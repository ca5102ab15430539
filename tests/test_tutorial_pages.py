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

<!-- tutorial: long -->
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
    assert [c.text for c in first.commands] == ["echo one && \n  echo two", "fedge-coordinator run --rounds 2"]
    assert first.commands[0].shown == ["one", "two"] and first.commands[0].line == 4
    assert first.kind == "run" and second.kind == "long" and second.commands[0].shown == []


def test_ellipses_match_what_varies_and_nothing_else():
    shown = ["...", "final test accuracy ... after 2 rounds (... bytes moved)"]
    assert mismatch(shown, "round 1\nround 2\nfinal test accuracy 0.8412 after 2 rounds (1,024 bytes moved)\n") == ""
    assert mismatch(shown, "final test accuracy 0.8412 after 3 rounds (1 bytes moved)") != ""
    assert mismatch(["one", "two"], "one\ntwo\n\n") == ""
    assert "did not print" in mismatch(["one", "three"], "one\ntwo")
    assert "does not show" in mismatch(["one"], "one\ntwo")
    assert mismatch([], "") == "" and mismatch([], "something") != ""
