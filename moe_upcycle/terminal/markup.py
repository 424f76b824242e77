"""Text from files and users, made safe to print with rich: markup escaped, control characters shown.

A tensor name, a path or a prompt comes from a file someone else wrote. Printed as it is, an escape
sequence in it would clear the screen or recolour what follows, and a carriage return would overwrite
the line; rich's own `escape` handles only its ``[markup]``. Newlines and tabs stay (messages are
multi-line); every other control character is shown the way Python writes it (``\\x1b``).
"""

from __future__ import annotations

import re

from rich.markup import escape as escape_markup

# C0 controls but tab and newline, DEL, C1 controls; and the line and paragraph separators some terminals honour
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029]")


def escape(text: str) -> str:
    r"""`text` for `Console.print`: rich markup escaped, control characters but newline and tab made visible.

    Example:
        >>> print(escape("[bold]w\x1b[2J\rdone"))
        \[bold]w\x1b[2J\rdone
    """
    return escape_markup(printable(text))


def printable(text: str) -> str:
    r"""`text` with every control character but newline and tab shown the way Python writes it (for output
    printed without markup).

    Example:
        >>> print(printable("a\x1b[2Jb\r"))
        a\x1b[2Jb\r
    """
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)
