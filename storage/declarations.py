"""Reading what a declaration says about its fields: the comment on each field's line of a dataclass.

Settings sections and wire message bodies are frozen dataclasses whose fields carry their explanation as a
comment; reading it from the source keeps one declaration per field, from which the settings reference and
the published message schemas are generated (``coordinator.settings_schema``, ``edge_client.wire.schema``).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import io
import tokenize

__all__ = ["key_comments"]


@functools.cache
def key_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment that explains it in ``cls``'s source (its own line's, then comment lines right
    under it), for a dataclass and the classes it inherits fields from."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if dataclasses.is_dataclass(klass) and klass is not object:
            found.update(_comments_of(klass))
    return found


def _comments_of(cls: type) -> dict[str, str]:
    """A field's comment: the one on its line and the comment lines under it indented past the fields (how a long
    comment goes on), or else the comment lines right above it at the fields' indent."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):   # defined where no source is kept
        return {}
    fields = {f.name for f in dataclasses.fields(cls)}
    tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    code_rows = {t.start[0] for t in tokens if t.type not in (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE,
                                                                tokenize.INDENT, tokenize.DEDENT)}
    comments = {t.start[0]: (t.start[1], t.string.lstrip("#").strip()) for t in tokens if t.type == tokenize.COMMENT}
    indent = next((t.start[1] for t in tokens if t.type == tokenize.NAME and t.string in fields), 4)
    rows = {}
    for i, t in enumerate(tokens[:-1]):
        if (t.type == tokenize.NAME and t.string in fields and t.start[1] == indent
                and tokens[i + 1].string == ":" and t.string not in rows):
            rows[t.string] = t.start[0]
    found: dict[str, str] = {}
    shared, last_row = "", -1   # a comment above a group of fields (no blank line between) explains each
    for name, row in sorted(rows.items(), key=lambda item: item[1]):
        parts = [comments[row][1]] if row in comments else []
        below = row + 1
        while parts and below in comments and below not in code_rows and comments[below][0] > indent:
            parts.append(comments[below][1])
            below += 1
        above = row - 1
        preamble = []
        while not parts and above in comments and above not in code_rows and comments[above][0] == indent:
            preamble.insert(0, comments[above][1])
            above -= 1
        if parts:
            shared = ""
        elif preamble:
            shared = " ".join(preamble)
        elif row != last_row + 1:
            shared = ""
        found[name], last_row = " ".join(parts) or shared, row
    return found
