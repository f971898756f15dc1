"""Log records a peer cannot forge: every control character in a record's text is shown, not
emitted.

Ids, addresses, reasons and details that come from the network end up in log lines (``%s``
arguments, exception texts). A transfer id with a newline would otherwise start a record of
its own -- timestamp, level and all -- and terminal escapes would repaint the operator's
screen. ``shown`` is the one helper that makes any text safe for one log line: C0 and C1
control characters, DEL and Unicode's line and paragraph separators become ``\\n``, ``\\x1b``,
``\\u2028``...; everything else (non-ASCII letters included) is kept. ``OneLineFilter`` applies
it to the whole message of every record a handler emits (the CLI and the endpoint workers put
it on their handlers), so no call site can forget it; a traceback (``exc_info``) is left as
it is. Pure; any thread.
"""

from __future__ import annotations

import logging
import re

_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(m: re.Match[str]) -> str:
    c = m.group(0)
    named = _NAMED.get(c)
    if named is not None:
        return named
    n = ord(c)
    return f"\\x{n:02x}" if n < 0x100 else f"\\u{n:04x}"


def shown(text: str) -> str:
    """``text`` with every control character escaped (one printable line)."""
    return _CONTROL.sub(_escape, text) if _CONTROL.search(text) else text


class OneLineFilter(logging.Filter):
    """Escape the control characters of each record's message (its arguments merged in)."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            msg = record.getMessage()
        except Exception:  # a bad format: let the handler report it as usual
            return True
        safe = shown(msg)
        if safe is not msg:
            record.msg, record.args = safe, None
        return True


def install(handler: logging.Handler) -> logging.Handler:
    """Put ``OneLineFilter`` on ``handler`` (returned, for chaining)."""
    handler.addFilter(OneLineFilter())
    return handler
